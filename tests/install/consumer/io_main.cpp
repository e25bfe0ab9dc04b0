// Built against the installed package when it has conveyor::io: the header,
// the library and its libcurl dependency as a user gets them. No network: an
// unsupported scheme is refused with a DataError naming the URL.
#include <conveyor/nodes.h>
#include <conveyor/nodes/http.h>

#include <cstdio>
#include <string>
#include <vector>

int main() {
  auto pipeline = conveyor::nodes::from_vector(std::vector<std::string>{"ftp://example.invalid/a"}) |
                  conveyor::nodes::http_get({});
  try {
    auto pass = pipeline.pass();
    pass.next();
  } catch (const conveyor::DataError& e) {
    if (std::string(e.what()).find("ftp://example.invalid/a") == std::string::npos) return 1;
    std::printf("installed conveyor::io refuses %s\n", e.file().c_str());
    return 0;
  }
  std::fprintf(stderr, "an ftp URL was fetched\n");
  return 1;
}
