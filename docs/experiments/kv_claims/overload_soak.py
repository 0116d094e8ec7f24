"""A sustained KV overload on two routers with shared KV claims, with a Redis restart and a router killed meanwhile.

A 1P:1D tiny-random cluster (`pdserve up` on a redis-server of its own, 300 KV blocks a worker, decode steps slowed
by 10 ms) and a second router (`pdserve router`). Thirty clients, alternating between the routers, send requests back
to back, one in eight large (prompt 800-2000 tokens, the others 50-150; 100-250 out), and retry a RESOURCE_EXHAUSTED
after its hint; another error is retried after 0.5 s. At --redis-restart-at seconds Redis is stopped for 5 s, at
--router-kill-at the second router is SIGKILLed and started again on its port. The claims hash is sampled every 2 s,
the routers' memory, threads and descriptors every 15 s, `pdserve status` after the load. Everything goes under
--out (requests.jsonl, claims.jsonl, proc.jsonl, status.jsonl, events.jsonl, the logs); overload_report.py reads it.

    PYTHONPATH=src:. python docs/experiments/kv_claims/overload_soak.py --out /tmp/soak   # about 12 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import redis as redislib

from pdserve.cluster.local_process import ClusterProcess, PdserveProcess, descendants, free_port
from pdserve.rpc.errors import retry_after_ms
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.redis_server import RedisServer

BLOCKS = 300
CLIENTS = 30
STEP_S = 0.01
PREFIX = "soak-"
CLAIMS_KEY = "pdserve:kv_claims"

T0 = time.monotonic()


def now() -> float:
    return round(time.monotonic() - T0, 3)


class Out:
    def __init__(self, d: Path) -> None:
        self.d = d
        self.lock = threading.Lock()
        self.files: dict[str, object] = {}

    def write(self, name: str, rec: dict) -> None:
        with self.lock:
            f = self.files.get(name)
            if f is None:
                f = self.files[name] = open(self.d / name, "a")  # noqa: SIM115 (open for the whole run)
            f.write(json.dumps(rec) + "\n")
            f.flush()


def make_request(rid: str, large: bool, rng: random.Random) -> pb.GenerateRequest:
    plen = rng.randint(800, 2000) if large else rng.randint(50, 150)
    out = rng.randint(100, 250)
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[rng.randrange(3, 250) for _ in range(plen)],
        sampling=pb.SamplingParams(max_tokens=out, ignore_eos=True),
    )


async def client(n: int, router: int, addr_holder: list[str], stop: asyncio.Event, out: Out) -> None:
    rng = random.Random(1000 + n)
    ch = channel(addr_holder[router])
    stub = generate_pb2_grpc.GenerationStub(ch)
    i = 0
    try:
        while not stop.is_set():
            large = rng.random() < 1 / 8
            req = make_request(f"{PREFIX}{n}-{i}", large, rng)
            i += 1
            rec = {
                "id": req.request_id,
                "router": router,
                "large": large,
                "prompt": len(req.prompt_token_ids),
                "max_tokens": req.sampling.max_tokens,
                "start": now(),
                "refusals": 0,
                "no_hint": 0,
                "refusal_msgs": {},
                "errors": [],
                "ttft": None,
                "tokens": 0,
                "status": None,
                "end": None,
            }
            first_send = time.monotonic()
            while True:
                tokens = 0
                try:
                    async for msg in stub.Generate(req, timeout=180):
                        if msg.token_ids and rec["ttft"] is None:
                            rec["ttft"] = round(time.monotonic() - first_send, 3)
                        tokens += len(msg.token_ids)
                    rec["tokens"] = tokens
                    rec["status"] = "OK"
                    break
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                    if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and tokens == 0:
                        rec["refusals"] += 1
                        hint = retry_after_ms(e.trailing_metadata())
                        if hint is None:
                            rec["no_hint"] += 1
                        key = re.sub(r"\d+", "N", e.details() or "")[:120]
                        rec["refusal_msgs"][key] = rec["refusal_msgs"].get(key, 0) + 1
                        rec["status"] = "RESOURCE_EXHAUSTED"
                        if stop.is_set():
                            break
                        await asyncio.sleep((hint or 100) / 1e3)
                        continue
                    rec["errors"].append({"t": now(), "code": code, "msg": (e.details() or "")[:300], "tokens": tokens})
                    rec["status"] = code
                    if stop.is_set() or len(rec["errors"]) >= 100:
                        break
                    await asyncio.sleep(0.5)  # reconnect/retry the same request
                    continue
                except Exception as e:  # noqa: BLE001
                    rec["errors"].append({"t": now(), "code": "EXC", "msg": repr(e)[:300], "tokens": tokens})
                    rec["status"] = "EXC"
                    if stop.is_set() or len(rec["errors"]) >= 100:
                        break
                    await asyncio.sleep(0.5)
            rec["end"] = now()
            out.write("requests.jsonl", rec)
    finally:
        await ch.close()


def proc_sample(pid: int) -> dict:
    d = {"pid": pid}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "VmSize", "Threads"):
                d[k] = v.strip()
        d["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError as e:
        d["err"] = repr(e)
    return d


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def status_json(address: str) -> dict | str:
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--addr", address, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        return f"rc={r.returncode} {r.stderr[-2000:]}"
    try:
        return json.loads(r.stdout)
    except ValueError:
        return r.stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True, help="the run's directory (emptied first)")
    p.add_argument("--load-s", type=float, default=600)
    p.add_argument("--redis-restart-at", type=float, default=150)
    p.add_argument("--router-kill-at", type=float, default=330)
    p.add_argument("--after-s", type=float, default=60)
    args = p.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    out = Out(args.out)

    def event(what: str, **kw) -> None:
        rec = {"t": now(), "event": what, **kw}
        print(json.dumps(rec), flush=True)
        out.write("events.jsonl", rec)

    env = {"PDSERVE_FAULT_SLOW_STEP_S": str(STEP_S), "PDSERVE_FAULT_SLOW_STEP_REQUEST_ID_PREFIX": PREFIX}
    redis_srv = RedisServer()
    redis_srv.start()
    event("redis started", url=redis_srv.url)
    cluster_args = [
        "--model",
        "tiny-random",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-cache-gb",
        str(BLOCKS * 8192 / 2**30),
        "--no-access-log",
        "--redis",
        redis_srv.url,
    ]
    stop_sampling = threading.Event()
    with contextlib.ExitStack() as stack:
        stack.callback(redis_srv.stop)
        cluster = ClusterProcess(*cluster_args, log_path=args.out / "cluster.log", env=env)
        stack.callback(cluster.stop)
        event("cluster ready", address=cluster.address, pid=cluster.proc.pid)
        port2 = free_port()
        router_env = {"PDSERVE_CLUSTER_SECRET": cluster.cluster_secret}

        def start_router2(n: int) -> PdserveProcess:
            r = PdserveProcess(
                "router",
                "--model",
                "tiny-random",
                "--redis",
                redis_srv.url,
                "--port",
                str(port2),
                "--no-access-log",
                log_path=args.out / f"router2_{n}.log",
                env=router_env,
            )
            r.wait_ready()
            return r

        routers2 = [start_router2(0)]
        stack.callback(lambda: routers2[-1].stop())
        addrs = [cluster.address, f"127.0.0.1:{port2}"]
        event("router2 ready", address=addrs[1], pid=routers2[0].proc.pid)
        tree = {pid: cmdline(pid) for pid in sorted(descendants(cluster.proc.pid))}
        event("cluster process tree", up_pid=cluster.proc.pid, up_cmd=cmdline(cluster.proc.pid), tree=tree)
        out.write("status.jsonl", {"t": now(), "phase": "before", "status": status_json(cluster.address)})

        # Samplers: claims hash every 2 s; router procs every 15 s.
        rc = redislib.Redis(host="127.0.0.1", port=redis_srv.port, socket_timeout=1, socket_connect_timeout=1)

        def sampler() -> None:
            last_proc = 0.0
            while not stop_sampling.is_set():
                t = now()
                try:
                    h = {k.decode(): v.decode() for k, v in rc.hgetall(CLAIMS_KEY).items()}
                    out.write("claims.jsonl", {"t": t, "wall_ms": int(time.time() * 1000), "claims": h})
                except Exception as e:  # noqa: BLE001
                    out.write("claims.jsonl", {"t": t, "err": repr(e)[:200]})
                if time.monotonic() - last_proc >= 15:
                    last_proc = time.monotonic()
                    out.write(
                        "proc.jsonl",
                        {
                            "t": t,
                            "router1": proc_sample(cluster.proc.pid),
                            "router2": proc_sample(routers2[-1].proc.pid),
                            "router2_gen": len(routers2) - 1,
                        },
                    )
                stop_sampling.wait(2.0)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()

        async def run_load() -> None:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(client(n, n % 2, addrs, stop, out)) for n in range(CLIENTS)]
            event("load started")
            t_start = time.monotonic()
            did_redis = did_kill = False
            while time.monotonic() - t_start < args.load_s:
                el = time.monotonic() - t_start
                if not did_redis and el >= args.redis_restart_at:
                    did_redis = True
                    event("redis stop")
                    await asyncio.to_thread(redis_srv.stop)
                    await asyncio.sleep(5)
                    await asyncio.to_thread(redis_srv.start)
                    event("redis started again")
                if not did_kill and el >= args.router_kill_at:
                    did_kill = True
                    old = routers2[-1]
                    event("router2 SIGKILL", pid=old.proc.pid, before=proc_sample(old.proc.pid))
                    await asyncio.to_thread(old.stop, signal.SIGKILL)
                    new = await asyncio.to_thread(start_router2, len(routers2))
                    routers2.append(new)
                    event("router2 new ready", pid=new.proc.pid, sample=proc_sample(new.proc.pid))
                    out.write(
                        "proc.jsonl",
                        {
                            "t": now(),
                            "router1": proc_sample(cluster.proc.pid),
                            "router2": proc_sample(new.proc.pid),
                            "router2_gen": len(routers2) - 1,
                        },
                    )
                await asyncio.sleep(1)
            event("load stopping")
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            event("load stopped")

        asyncio.run(run_load())
        t_stop = time.monotonic()
        for t_after in (2, 10, 30, args.after_s):
            time.sleep(max(0.0, t_stop + t_after - time.monotonic()))
            for i, a in enumerate(addrs):
                out.write(
                    "status.jsonl",
                    {"t": now(), "phase": f"after+{t_after:g}", "router": i + 1, "status": status_json(a)},
                )
        out.write(
            "proc.jsonl",
            {
                "t": now(),
                "phase": "end",
                "router1": proc_sample(cluster.proc.pid),
                "router2": proc_sample(routers2[-1].proc.pid),
                "router2_gen": len(routers2) - 1,
            },
        )
        stop_sampling.set()
        th.join()
        event("done; stopping cluster")
        # Copy logs before stop: stop writes the shutdown part too, keep both.
        shutil.copy(args.out / "cluster.log", args.out / "cluster_before_stop.log")
    event("stopped")


if __name__ == "__main__":
    main()
