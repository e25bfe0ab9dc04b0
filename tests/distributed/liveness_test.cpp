// The liveness mesh in one process: every "rank" is a thread with its own
// port, so the backlog and the strangers on a port can be set up exactly.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "distributed/liveness.h"

namespace {

using conveyor::distributed::detail::LivenessPort;
using conveyor::distributed::detail::Peer;
using conveyor::distributed::detail::Watch;
using std::chrono::milliseconds;

struct Ranks {
  std::vector<std::unique_ptr<LivenessPort>> ports;
  std::vector<Peer> peers;
  std::vector<std::unique_ptr<Watch>> watches;
  std::vector<std::string> errors;

  Ranks(int world, int backlog) {
    for (int rank = 0; rank < world; ++rank) {
      ports.push_back(std::make_unique<LivenessPort>("127.0.0.1", backlog));
      peers.push_back(ports.back()->self());
    }
    watches.resize(world);
    errors.resize(world);
  }

  // Builds the watches of `ranks` at once, as the processes of a job do.
  void build(const std::vector<int>& ranks, milliseconds budget) {
    std::vector<std::thread> threads;
    for (int rank : ranks) {
      threads.emplace_back([this, rank, budget] {
        try {
          watches[rank] = std::make_unique<Watch>(peers, rank, *ports[rank], budget);
        } catch (const std::exception& error) {
          errors[rank] = error.what();
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
};

std::vector<int> all_ranks(int world) {
  std::vector<int> out;
  for (int rank = 0; rank < world; ++rank) out.push_back(rank);
  return out;
}

// A raw connection to `peer`'s port that sends `bytes` (none when empty).
int stranger(const Peer& peer, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(peer.port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  if (!bytes.empty()) {
    EXPECT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  return fd;
}

std::string hello(uint32_t rank, uint64_t pid) {
  std::string out = "cnvL";
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(rank >> (24 - 8 * i)));
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(pid >> (56 - 8 * i)));
  return out;
}

TEST(LivenessMesh, FormsWithMoreRanksThanAListenBacklogHolds) {
  // Each port's backlog holds 2 connections; rank 0 gets 23. A port that
  // never accepted left every connection past the backlog unanswered.
  constexpr int kWorld = 24;
  Ranks job(kWorld, /*backlog=*/1);
  job.build(all_ranks(kWorld), milliseconds(20000));
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_EQ(job.errors[rank], "") << "rank " << rank;
  }
  // Every connection stays open while its two ends live.
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_EQ(job.watches[rank]->gone(milliseconds(20), milliseconds(0)), std::vector<int>{})
        << "rank " << rank;
  }
  // A rank that goes closes both ends it holds: the lower ranks' (accepted
  // from it) and the higher ranks' (made to its port) see it.
  job.watches[7].reset();
  job.ports[7].reset();
  for (int rank = 0; rank < kWorld; ++rank) {
    if (rank == 7) continue;
    EXPECT_EQ(job.watches[rank]->gone(milliseconds(5000), milliseconds(0)), std::vector<int>{7})
        << "rank " << rank;
  }
}

TEST(LivenessMesh, ConnectionsThatDoNotSayTheyAreAHigherRankAreNotCounted) {
  constexpr int kWorld = 3;
  Ranks job(kWorld, 0);
  const uint64_t pid = static_cast<uint64_t>(::getpid());
  // On rank 1's port, before any rank connects: silence, a stranger's bytes,
  // a hello from the wrong process, one naming a lower rank, one past the world.
  std::vector<int> strangers = {
      stranger(job.peers[1], ""),
      stranger(job.peers[1], "GET / HTTP/1.1\r\n"),
      stranger(job.peers[1], hello(2, pid + 1)),
      stranger(job.peers[1], hello(0, pid)),
      stranger(job.peers[1], hello(3, pid)),
  };
  job.build(all_ranks(kWorld), milliseconds(10000));
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_EQ(job.errors[rank], "") << "rank " << rank;
    EXPECT_EQ(job.watches[rank]->gone(milliseconds(20), milliseconds(0)), std::vector<int>{})
        << "rank " << rank;
  }
  // The strangers that spoke were closed: they read the end of the stream.
  for (size_t i = 1; i < strangers.size(); ++i) {
    pollfd entry{strangers[i], POLLIN, 0};
    ASSERT_EQ(::poll(&entry, 1, 5000), 1) << "stranger " << i << " is still connected";
    char byte = 0;
    EXPECT_EQ(::recv(strangers[i], &byte, 1, 0), 0) << "stranger " << i;
  }
  for (int fd : strangers) ::close(fd);
  // Rank 2 going is still seen by rank 1, through the connection it accepted.
  job.watches[2].reset();
  EXPECT_EQ(job.watches[1]->gone(milliseconds(5000), milliseconds(0)), std::vector<int>{2});
}

size_t open_descriptors() {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                           std::filesystem::directory_iterator{}));
}

TEST(LivenessMesh, ARankThatNeverConnectsIsNamed) {
  Ranks job(3, 0);
  const size_t before = open_descriptors();
  job.build({0, 1}, milliseconds(300));
  // Rank 0 had rank 1's connection when it gave up: it closed it.
  EXPECT_EQ(open_descriptors(), before);
  EXPECT_NE(job.errors[0].find("rank 2 did not connect to this rank's liveness port 127.0.0.1:" +
                               std::to_string(job.peers[0].port) + " within 300 ms"),
            std::string::npos)
      << job.errors[0];
  EXPECT_NE(job.errors[1].find("rank 2 did not connect"), std::string::npos) << job.errors[1];
}

TEST(LivenessMesh, AClosedPortIsNamedWithItsRank) {
  Ranks job(2, 0);
  job.ports[0].reset();
  job.build({1}, milliseconds(2000));
  EXPECT_NE(job.errors[1].find("cannot connect to rank 0's liveness port 127.0.0.1:" +
                               std::to_string(job.peers[0].port)),
            std::string::npos)
      << job.errors[1];
}

}  // namespace
