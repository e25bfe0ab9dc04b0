#!/usr/bin/python3
"""Runs conveyor's performance suite: every workload on every peer, under
/usr/bin/time -v, with repetitions, and writes perf/results/results.json.
Called by perf/run_all (which builds the drivers first); perf/README.md
documents the workloads, peers, limits and environment variables.

Standard library only.
"""
import json
import os
import platform
import pwd
import grp
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env_float(name, default):
    value = os.environ.get(name, "")
    return float(value) if value.strip() else default


def env_int(name, default):
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def env_list(name, default):
    value = os.environ.get(name, "")
    return value.split() if value.strip() else default


# ---- the suite's parameters (perf/README.md) -------------------------------

BATCH = {"W0": 8, "W1": 256, "W2": 64, "W3": 32, "W4": 32, "W5": 64, "W6": 64}
WORKERS = {"W0": [0, 1, 2, 4], "W1": [0, 1, 2, 4], "W2": [1, 2], "W3": [1, 4, 16, 64],
           "W4": [4, 16], "W5": [1, 2], "W6": [2, 64]}
W4_MODES = [("round_robin", 1), ("round_robin", 0), ("work_stealing", 1), ("work_stealing", 0)]
# conveyor with torch samples on W4: its defaults, and PyTorch's schedule.
W4_TORCH_MODES = [(None, None), ("round_robin", 1)]
# Where each peer runs: conveyor-torch has no W5 (W5's samples are the
# decoder's own in both C++ peers).
TORCH_SAMPLE_WORKLOADS = ("W0", "W1", "W2", "W3", "W4")
# W5 as a node graph batching before its workers, from disk and over HTTP.
NODE_GRAPH_PEERS = ("conveyor-nodes-batched", "conveyor-nodes-batched-http")
# W5 with its shards streamed from a local nginx: the DataLoader, the graph.
HTTP_PEERS = ("conveyor-http", "conveyor-nodes-batched-http")
NAMES = {"W0": "tiny (8-byte samples)", "W1": "overhead-bound (in-memory 3x32x32 float32)",
         "W2": "CPU-bound (~50 us of arithmetic per sample)", "W3": "latency-bound (1 ms sleep per sample)",
         "W4": "stragglers (50 us, every 100th sample 20 ms)",
         "W5": "real (Fashion-MNIST JPEG tar shards: decode + augment)",
         "W6": "remote objects (10,000 JPEGs, one HTTP GET each from a local nginx: decode)"}
PREFETCH_FACTOR = 2
W1_SAMPLES = 10000
W1_SAMPLE_BYTES = 3 * 32 * 32 * 4 + 8
W5_SAMPLE_BYTES = 28 * 28 * 4 + 8
W3_LATENCY_US = 1000.0
# W3-async (peer conveyor-async): requests in flight through async_map, on the
# consumer's thread and one timer thread.
ASYNC_IN_FLIGHT = [256, 1024]
# W6-http: conveyor's GETs outstanding (http_get on the consumer's thread, the
# decode on W workers), as many as LibTorch's 64 threads have at W=64.
W6_IN_FLIGHT = 64
W4_MEAN_US = 0.99 * 50.0 + 0.01 * 20000.0  # 249.5 us
MIB = 1024 * 1024


class NginxServer:
    """nginx on a free 127.0.0.1 port serving the W5 shards' directory (W5 over
    HTTP, and W6's objects in its w6-objects/), configured in a temporary
    directory; stop() ends it."""

    def __init__(self, shards):
        self.root = os.path.dirname(os.path.abspath(shards[0])) if shards else ""
        self.dir = None
        self.process = None
        self.port = 0

    @staticmethod
    def binary():
        for candidate in ("/usr/sbin/nginx", shutil.which("nginx") or ""):
            if candidate and os.access(candidate, os.X_OK):
                return candidate
        return None

    def urls(self, shards):
        return [f"http://127.0.0.1:{self.port}/{os.path.basename(s)}" for s in shards]

    def url(self, relative):
        return f"http://127.0.0.1:{self.port}/{relative}"

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="conveyor-perf-nginx-")
        with socket.socket() as probe:  # a free port (nginx binds it a moment later)
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        user = ""
        if os.geteuid() == 0:  # workers would become nobody, who cannot read a 0700 directory
            entry = pwd.getpwuid(os.geteuid())
            user = f"user {entry.pw_name} {grp.getgrgid(entry.pw_gid).gr_name};\n"
        temp = "".join(f"  {kind}_temp_path {self.dir}/{kind};\n"
                       for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        config = (f"daemon off;\nworker_processes 1;\npid {self.dir}/nginx.pid;\nerror_log {self.dir}/error.log warn;\n"
                  f"{user}events {{ worker_connections 1024; }}\n"
                  f"http {{\n  access_log off;\n{temp}  default_type application/octet-stream;\n"
                  f"  sendfile on;\n  keepalive_requests 100000;\n"
                  f"  server {{\n    listen 127.0.0.1:{self.port};\n    root {self.root};\n  }}\n}}\n")
        with open(os.path.join(self.dir, "nginx.conf"), "w") as f:
            f.write(config)
        self.process = subprocess.Popen([self.binary(), "-p", self.dir + "/", "-c", self.dir + "/nginx.conf",
                                         "-e", self.dir + "/error.log"])
        deadline = time.time() + 10
        while time.time() < deadline:
            if self.process.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                print(f"nginx serving {self.root} on 127.0.0.1:{self.port} (W5 over HTTP, W6)", flush=True)
                return
            except OSError:
                time.sleep(0.02)  # the connect poll's pace
        log = open(os.path.join(self.dir, "error.log")).read() if os.path.exists(self.dir + "/error.log") else ""
        self.stop()
        raise RuntimeError("nginx did not start for W5 over HTTP:\n" + log)

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class Suite:
    def __init__(self):
        self.build = os.path.abspath(os.environ.get("PERF_BUILD_DIR", os.path.join(ROOT, "build-perf")))
        self.out = os.path.abspath(os.environ.get("PERF_RESULTS_DIR", os.path.join(ROOT, "perf", "results")))
        self.reps = max(1, env_int("PERF_REPS", 3))
        self.seconds = env_float("PERF_SECONDS", 2.0)
        self.warmup = env_float("PERF_WARMUP", 1.0)
        self.workloads = env_list("PERF_WORKLOADS", ["W0", "W1", "W2", "W3", "W4", "W5", "W6"])
        self.peers = env_list("PERF_PEERS", ["conveyor", "conveyor-torch", "conveyor-nodes", "conveyor-nodes-batched",
                                             "conveyor-async", "conveyor-http", "conveyor-nodes-batched-http", "libtorch",
                                             "python"])
        self.shards = [s for s in os.environ.get("PERF_W5_SHARDS", "").split(",") if s]
        self.objects_pattern = ""  # W6's URLs, set once nginx serves them
        self.python = os.environ.get("PERF_PYTHON", "/usr/bin/python3")
        self.timeout = env_float("PERF_RUN_TIMEOUT", 120.0)
        self.time_bin = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
        self.cores = os.cpu_count() or 1
        self.notes = []
        self.runs = []
        self.started = time.time()
        self.durations = {}  # kind -> [seconds]

    # ---- drivers -----------------------------------------------------------

    def binary(self, name):
        path = os.path.join(self.build, "perf", name)
        return path if os.access(path, os.X_OK) else None

    def driver_command(self, peer, workload, workers, scheduling=None, in_order=None):
        common = ["--workload", workload, "--workers", str(workers), "--seconds", str(self.seconds),
                  "--warmup", str(self.warmup)]
        if workload == "W2":
            iterations = self.calibration["python" if peer == "python" else "c++"]["w2_iterations"]
            common += ["--w2-iterations", str(iterations)]
        if workload == "W5":
            common += ["--shards", ",".join(self.shards)]
        if workload == "W6":
            common += ["--objects", self.objects_pattern]
            if peer == "conveyor":
                common += ["--in-flight", str(W6_IN_FLIGHT)]
        if peer in HTTP_PEERS:  # the same shards' URLs (the server is started in run())
            common[common.index("--shards") + 1] = ",".join(self.http_server.urls(self.shards))
        if peer in ("conveyor-nodes",) + NODE_GRAPH_PEERS:
            pipeline = peer.removeprefix("conveyor-").removesuffix("-http")
            return [self.binary("conveyor_driver")] + common + ["--pipeline", pipeline]
        if peer == "conveyor-http":
            return [self.binary("conveyor_driver")] + common
        if peer == "conveyor-async":  # `workers` is the requests in flight
            common[common.index("--workers") + 1] = "0"
            return [self.binary("conveyor_driver")] + common + ["--pipeline", "async", "--in-flight", str(workers)]
        if peer in ("conveyor", "conveyor-torch"):
            driver = "conveyor_driver" if peer == "conveyor" else "conveyor_torch_driver"
            command = [self.binary(driver)] + common
            if scheduling:
                command += ["--scheduling", scheduling]
            if in_order is not None:
                command += ["--in-order", str(in_order)]
            return command
        if peer == "libtorch":
            return [self.binary("libtorch_driver")] + common
        return [self.python, os.path.join(ROOT, "perf", "peers", "python_driver.py")] + common

    def available(self, peer, workload):
        if peer in ("conveyor", "conveyor-nodes", "conveyor-async") + NODE_GRAPH_PEERS + HTTP_PEERS and \
                not self.binary("conveyor_driver"):
            return "conveyor_driver was not built"
        if peer == "conveyor-async" and workload != "W3":
            return "the async peer runs W3 only (W3-async)"
        if peer in ("conveyor-nodes",) + NODE_GRAPH_PEERS and workload != "W5":
            return "the node-graph peer runs W5 only"
        if peer in HTTP_PEERS:
            if workload != "W5":
                return "the HTTP peers run W5 only (its shards streamed from a local nginx)"
            if not NginxServer.binary():
                return "nginx is not installed (Debian: nginx-light; scripts/setup installs it)"
        if peer == "conveyor-torch":
            if workload not in TORCH_SAMPLE_WORKLOADS:
                return "no torch-sample variant (W5's samples are the decoder's own)"
            if not self.binary("conveyor_torch_driver"):
                return "conveyor_torch_driver was not built (CONVEYOR_WITH_TORCH=OFF or LibTorch missing)"
        if peer == "libtorch" and not self.binary("libtorch_driver"):
            return "libtorch_driver was not built (CONVEYOR_WITH_TORCH=OFF or LibTorch missing)"
        if peer == "python" and not self.has_torch_python:
            return f"{self.python} cannot import torch (python3-torch)"
        if workload in ("W5", "W6"):
            if not self.shards:
                return "no shards (conveyor-make-shards was not built or failed)"
            if peer == "python" and not self.has_pil:
                return "PIL (python3-pil) and numpy are not importable"
        if workload == "W6":
            if peer not in ("conveyor", "libtorch", "python"):
                return "W6 runs on conveyor (http_get), LibTorch and Python"
            if not NginxServer.binary():
                return "nginx is not installed (Debian: nginx-light; scripts/setup installs it)"
            if not self.objects_pattern:
                return "the W6 objects could not be written"
        return None

    # ---- running one command under /usr/bin/time -v ------------------------

    def measure(self, command):
        """Runs `command`; returns (stdout, stderr, rc, usage) where usage has
        max_rss_kb, user_s, system_s, wall_s."""
        usage = {}
        started = time.monotonic()
        if self.time_bin:
            with tempfile.NamedTemporaryFile("r", suffix=".time", delete=False) as handle:
                time_file = handle.name
            full = [self.time_bin, "-v", "-o", time_file] + command
        else:
            full = command
        # A session of its own: a timeout kills the driver with /usr/bin/time.
        # Killing time alone left the driver running, holding the pipes that
        # communicate() waits on: one hung driver hung the suite.
        process = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=ROOT, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=self.timeout)
            rc = process.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = process.communicate()
            rc = "timeout"
        usage["wall_s"] = time.monotonic() - started
        if self.time_bin:
            try:
                with open(time_file) as f:
                    text = f.read()
            except OSError:
                text = ""
            finally:
                try:
                    os.unlink(time_file)
                except OSError:
                    pass
            for key, pattern in (("max_rss_kb", r"Maximum resident set size \(kbytes\): (\d+)"),
                                 ("user_s", r"User time \(seconds\): ([\d.]+)"),
                                 ("system_s", r"System time \(seconds\): ([\d.]+)")):
                match = re.search(pattern, text)
                if match:
                    usage[key] = float(match.group(1))
            match = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
            if match:
                seconds = 0.0
                for part in match.group(1).split(":"):
                    seconds = seconds * 60 + float(part)
                usage["wall_s"] = seconds
        if "user_s" in usage and "system_s" in usage:
            usage["cpu_s"] = usage["user_s"] + usage["system_s"]
        return stdout, stderr, rc, usage

    @staticmethod
    def last_json(stdout):
        for line in reversed(stdout.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
        return None

    # ---- progress --------------------------------------------------------------

    def estimate(self, kind):
        done = self.durations.get(kind)
        if done:
            return sum(done) / len(done)
        guess = {"conveyor": 0.6, "conveyor-torch": 1.4, "libtorch": 1.4, "python": 2.5,
                 "memcpy": 0.7, "decode-limit": 1.0}.get(kind.split(":")[0], 1.0)
        extra = 2.0 if kind.endswith(":W5") and kind.startswith("python") else 0.0
        return self.warmup + self.seconds + guess + extra

    def progress(self, index, total, label, remaining):
        eta = sum(self.estimate(kind) for kind in remaining)
        elapsed = time.time() - self.started
        print(f"[{index}/{total}] {label}  (elapsed {elapsed / 60:.1f} min, ETA {eta / 60:.1f} min)", flush=True)

    # ---- the suite ---------------------------------------------------------------

    def calibrate(self):
        self.calibration = {}
        limits = self.binary("conveyor_perf_limits")
        if limits:
            print("calibrating C++ (W2 spin iterations for 50 us; W3/W4 measured sleeps) ...", flush=True)
            stdout, stderr, rc, _ = self.measure([limits, "--calibrate"])
            self.calibration["c++"] = self.last_json(stdout) or {"error": stderr[-2000:]}
        if self.has_torch_python:
            print("calibrating Python (W2 spin iterations for 50 us) ...", flush=True)
            stdout, stderr, rc, _ = self.measure(
                [self.python, os.path.join(ROOT, "perf", "peers", "python_driver.py"), "--calibrate"])
            self.calibration["python"] = self.last_json(stdout) or {"error": stderr[-2000:]}
        for language, values in self.calibration.items():
            print(f"  {language}: {json.dumps(values)}", flush=True)

    def plan(self):
        jobs = []  # (kind, label, meta, command)
        for workload in self.workloads:
            if workload not in WORKERS:
                self.notes.append(f"unknown workload {workload} skipped")
                continue
            for workers in WORKERS[workload]:
                if workload == "W1" and self.binary("conveyor_perf_limits"):
                    command = [self.binary("conveyor_perf_limits"), "--memcpy", "--threads", str(max(1, workers)),
                               "--seconds", str(self.seconds), "--samples", str(W1_SAMPLES),
                               "--batch-size", str(BATCH["W1"])]
                    jobs.append(("memcpy", f"W1 memcpy limit threads={max(1, workers)}",
                                 {"peer": "memcpy", "workload": "W1", "workers": workers}, command))
                if workload == "W5" and self.shards and self.binary("conveyor_driver"):
                    command = [self.binary("conveyor_driver"), "--workload", "W5", "--workers", str(workers),
                               "--seconds", str(self.seconds), "--warmup", str(self.warmup),
                               "--shards", ",".join(self.shards), "--pipeline", "limit"]
                    jobs.append(("decode-limit", f"W5 decode limit threads={max(1, workers)}",
                                 {"peer": "decode-limit", "workload": "W5", "workers": workers}, command))
                for peer in self.peers:
                    if peer == "conveyor-async":
                        continue  # by requests in flight, below
                    why = self.available(peer, workload)
                    if why:
                        note = f"{workload} {peer}: not run: {why}"
                        if note not in self.notes:
                            self.notes.append(note)
                        continue
                    if workload == "W2" and peer == "libtorch" and "c++" not in self.calibration:
                        continue
                    modes = [(None, None)]
                    if workload == "W4" and peer == "conveyor":
                        modes = W4_MODES
                    elif workload == "W4" and peer == "conveyor-torch":
                        modes = W4_TORCH_MODES
                    for scheduling, in_order in modes:
                        label = f"{workload} {peer} workers={workers}"
                        if scheduling:
                            label += f" {scheduling} in_order={in_order}"
                        meta = {"peer": peer, "workload": workload, "workers": workers,
                                "mode": f"{scheduling}, in_order={'on' if in_order else 'off'}" if scheduling else ""}
                        jobs.append((f"{peer}:{workload}", label, meta,
                                     self.driver_command(peer, workload, workers, scheduling, in_order)))
            if "conveyor-async" in self.peers:
                why = self.available("conveyor-async", workload)
                if why:
                    if workload == "W3":
                        self.notes.append(f"W3 conveyor-async: not run: {why}")
                    continue
                for in_flight in ASYNC_IN_FLIGHT:
                    meta = {"peer": "conveyor-async", "workload": workload, "workers": in_flight,
                            "mode": f"{in_flight} in flight"}
                    jobs.append(("conveyor-async:W3", f"W3-async conveyor-async in_flight={in_flight}", meta,
                                 self.driver_command("conveyor-async", workload, in_flight)))
        return jobs

    def run(self):
        os.makedirs(self.out, exist_ok=True)
        self.has_torch_python = subprocess.run([self.python, "-c", "import torch"], capture_output=True).returncode == 0
        self.has_pil = subprocess.run([self.python, "-c", "import PIL, numpy"], capture_output=True).returncode == 0
        if not self.time_bin:
            self.notes.append("/usr/bin/time is missing (Debian package `time`): no peak RSS or CPU totals")
        self.calibrate()
        serve_w5 = any(p in self.peers for p in HTTP_PEERS) and "W5" in self.workloads
        serve_w6 = "W6" in self.workloads
        self.http_server = NginxServer(self.shards) if (serve_w5 or serve_w6) and self.shards else None
        try:
            if self.http_server and NginxServer.binary():
                self.http_server.start()
                if serve_w6:
                    count = self.write_w6_objects(self.http_server.root)
                    if count:
                        self.objects_pattern = self.http_server.url(
                            f"w6-objects/{{00000..{count - 1:05d}}}.jpg")
            self.run_jobs()
        finally:
            if self.http_server:
                self.http_server.stop()

    def write_w6_objects(self, root):
        """W6's objects: every JPEG of the W5 shards as a file of its own,
        root/w6-objects/00000.jpg ..., written once. Returns their count."""
        directory = os.path.join(root, "w6-objects")
        done = os.path.join(directory, "COMPLETE")
        if not os.path.exists(done):
            os.makedirs(directory, exist_ok=True)
            count = 0
            for shard in self.shards:
                with tarfile.open(shard) as tar:
                    for member in tar.getmembers():
                        if member.isfile() and member.name.endswith(".jpg"):
                            with open(os.path.join(directory, f"{count:05d}.jpg"), "wb") as out:
                                out.write(tar.extractfile(member).read())
                            count += 1
            with open(done, "w") as f:
                f.write(str(count))
            print(f"W6: wrote {count} JPEGs into {directory}", flush=True)
        with open(done) as f:
            return int(f.read() or 0)

    def run_jobs(self):
        jobs = self.plan()
        # Repetitions interleave: every configuration once, then again, so
        # that drift on a shared machine spreads over all of them.
        schedule = [(rep, job) for rep in range(self.reps) for job in jobs]
        total = len(schedule)
        print(f"{len(jobs)} configurations x {self.reps} repetitions = {total} runs, "
              f"{self.warmup:g} s warm-up + {self.seconds:g} s timed each", flush=True)
        for index, (rep, (kind, label, meta, command)) in enumerate(schedule, 1):
            remaining = [job[1][0] for job in schedule[index - 1:]]
            self.progress(index, total, f"{label}  rep {rep + 1}/{self.reps}", remaining)
            round_trip = self.core_round_trip()
            stdout, stderr, rc, usage = self.measure(command)
            self.durations.setdefault(kind, []).append(usage.get("wall_s", 0.0))
            result = self.last_json(stdout)
            record = dict(meta)
            record.update({"rep": rep, "command": " ".join(command), "rc": rc, "usage": usage})
            if round_trip is not None:
                record["core_round_trip_ns"] = round_trip
            if result is None or rc != 0:
                record["error"] = (stderr or "")[-1500:]
                print(f"    FAILED (rc {rc}): {(stderr or '').strip()[-300:]}", flush=True)
            else:
                record["result"] = result
                line = f"    {result.get('samples_per_s', 0):,.0f} samples/s"
                if "wait_p99_us" in result:
                    line += f", next() p50 {result['wait_p50_us']:.1f} us p99 {result['wait_p99_us']:.1f} us"
                if "max_rss_kb" in usage:
                    line += f", RSS {usage['max_rss_kb'] / 1024:.0f} MiB, CPU {usage.get('cpu_s', 0):.2f} s"
                if round_trip is not None:
                    line += f", core round trip {round_trip:.0f} ns"
                metrics = result.get("metrics")
                if metrics:  # conveyor's own (Epoch::metrics())
                    line += (f"\n    conveyor: stall {metrics['stall_pct']:.1f}%, fetch {metrics['fetch_s']:.3f} s, "
                             f"collate {metrics['collate_s']:.3f} s, in flight {metrics['mean_in_flight']:.1f}"
                             f" of {metrics['window']}")
                print(line, flush=True)
            self.runs.append(record)
            # What ran so far survives a suite cut short (killed, a machine
            # lost): results.partial.json, replaced after every run.
            self.write(partial=True)
        self.write()

    def core_round_trip(self):
        """The cache-line round trip between the first two CPUs just before a
        run, in ns (None with one CPU or no probe). A VM's host moves its
        vCPUs close together and apart within minutes, and work handed from
        core to core runs at two speeds with it (perf/README.md)."""
        probe = self.binary("conveyor_perf_limits")
        if not probe:
            return None
        try:
            done = subprocess.run([probe, "--core-round-trip"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return None
        result = self.last_json(done.stdout) if done.returncode == 0 else None
        return result.get("core_round_trip_ns") if result else None

    def machine(self):
        info = {"cores": self.cores, "platform": platform.platform(), "python": platform.python_version()}
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        info["cpu"] = line.split(":", 1)[1].strip()
                        break
            with open("/proc/meminfo") as f:
                info["memory"] = f.readline().split(":", 1)[1].strip()
        except OSError:
            pass
        return info

    def write(self, partial=False):
        document = {
            "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "duration_s": time.time() - self.started,
            "machine": self.machine(),
            "settings": {"reps": self.reps, "seconds": self.seconds, "warmup": self.warmup,
                         "workloads": self.workloads, "peers": self.peers, "shards": self.shards,
                         "prefetch_factor": PREFETCH_FACTOR, "batch_size": BATCH, "workers": WORKERS,
                         "w1_samples": W1_SAMPLES, "time_bin": self.time_bin},
            "calibration": self.calibration,
            "notes": self.notes,
            "runs": self.runs,
        }
        partial_path = os.path.join(self.out, "results.partial.json")
        path = partial_path if partial else os.path.join(self.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(document, f, indent=1)
        os.replace(path + ".tmp", path)
        if not partial:
            if os.path.exists(partial_path):
                os.unlink(partial_path)
            print(f"wrote {path}", flush=True)


def main():
    Suite().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
