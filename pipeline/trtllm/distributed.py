"""Checkpoint reference numerics with one rank per process (label: "checkpoint, reference numerics").

The streaming reference of :mod:`pipeline.trtllm.reference`, run as TensorRT-LLM runs an engine: one process per
rank, each loading only its own ``rank{N}.safetensors`` (one layer at a time, as the reference streams) onto its
own device; the ranks meet through ``torch.distributed`` (NCCL on GPUs, gloo on CPU):

- the TP all-reduce after attention and after the MLP is ``all_reduce(SUM)`` over the stage's TP group, and the
  parallel embedding's masked lookups are summed the same way (split on the hidden dim: ``all_gather``);
- a pipeline stage sends its hidden state to the next stage's rank with the same TP index (``send`` / ``recv``);
- the last stage's lm_head shards go to rank 0, which writes them side by side (the gather) and cuts the vocab
  padding; rank 0 alone yields logits, every other rank yields ``None`` per batch.

Rank layout, as TensorRT-LLM's ``Mapping`` (tensorrt_llm/mapping.py @ 05ebebb2, cp_size 1): ``tp_rank = rank %
tp_size``, ``pp_rank = rank // tp_size``, TP groups ``[pp_rank * tp_size, (pp_rank + 1) * tp_size)``,
``next_pp_rank = rank + tp_size``; ``local_rank = rank % gpus_per_node`` is the GPU a rank uses.

The numbers are the single-process reference's: the same per-rank computation, and float32 partial sums reduced
before the rounding to the checkpoint dtype. With 2 TP ranks the sum of two float32 tensors is the same in either
order, so tp 2 matches bit for bit; with more ranks NCCL / gloo may add in another order (float32 rounding, then at
most one unit in the last place of the checkpoint dtype).

Launch (one process per rank; world size = tp x pp of the checkpoint)::

    torchrun --standalone --nproc-per-node 2 -m pipeline.trtllm.distributed CKPT_DIR --out DIR \\
        [--samples 4 --seq-len 128 --batch 2 | --ids ids.pt] [--compare] [--resident] [--device auto|cuda|cpu]

Rank 0 writes ``DIR/result.json``: per rank its device, peak memory (``torch.cuda.max_memory_allocated`` on a GPU,
peak RSS on CPU), all-reduce time per layer, hand-off time; with ``--compare`` the single-process reference on
rank 0's device over the same ids and the agreement (max abs, top-1, cosine); ``--save-logits`` adds
``DIR/logits.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..host.rss import process_peak_rss_bytes
from .reference import LABEL, ReferenceModel

EXIT_OK, EXIT_ARGS = 0, 2      # forge's exit codes: 0 ok, 2 bad arguments / checkpoint


class DistributedReference(ReferenceModel):
    """One rank of :class:`ReferenceModel`; ``torch.distributed`` must be initialised with world = tp x pp.

    ``resident=True`` keeps the rank's decoder layers on its device after the first pass (in their stored form,
    as an engine holds them) instead of re-reading them; the streaming default holds one layer at a time.
    """

    def __init__(self, ckpt_dir: str | Path, *, kv_cache: str = "generation", device: str | torch.device | None = None,
                 resident: bool = False, threads: int | None = None):
        super().__init__(ckpt_dir, kv_cache=kv_cache, device=device, threads=threads)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: launch with torchrun (one process per rank)")
        world, self.rank = dist.get_world_size(), dist.get_rank()
        if world != self.tp * self.pp:
            raise ValueError(f"{self.dir / 'config.json'}: mapping tp_size {self.tp} x pp_size {self.pp} = "
                             f"{self.tp * self.pp} ranks, but {world} processes were launched (torchrun "
                             f"--nproc-per-node {self.tp * self.pp})")
        self.tp_rank, self.stage = self.rank % self.tp, self.rank // self.tp
        # new_group is collective: every process creates every stage's group, in the same order.
        groups = ([dist.new_group(list(range(s * self.tp, (s + 1) * self.tp))) for s in range(self.pp)]
                  if self.pp > 1 else [dist.group.WORLD])
        self.tp_group = groups[self.stage]
        self.resident = resident
        self._resident: dict[tuple[int, int], dict] = {}
        self._layer_now: str = "embedding"
        self.stats: dict[str, Any] = {"allreduce_calls": 0, "allreduce_bytes": 0, "allreduce_s_by_layer": {},
                                      "handoff_s": 0.0, "gather_s": 0.0}

    # ------------------------------------------------------------------ timing
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn) -> float:
        """Seconds ``fn`` (a collective / p2p call) takes once this rank's queued work is done; on a GPU it
        includes waiting for the slowest peer to arrive."""
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the hooks of ReferenceModel
    def _stage_ranks(self):
        return [(self.stage, [self.rank])]

    def _load_layer(self, rank: int, local: int) -> dict[str, Any]:
        if rank != self.rank:
            raise AssertionError(f"rank {self.rank} asked for rank {rank}'s layer")   # own rank file only
        self._layer_now = str(self.ranges[self.stage][local])
        if not self.resident:
            return super()._load_layer(rank, local)
        if (rank, local) not in self._resident:
            self._resident[(rank, local)] = super()._load_layer(rank, local)
        return self._resident[(rank, local)]

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dt = self._timed(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.tp_group))
        by = self.stats["allreduce_s_by_layer"]
        by[self._layer_now] = by.get(self._layer_now, 0.0) + dt
        self.stats["allreduce_calls"] += 1
        self.stats["allreduce_bytes"] += x.numel() * x.element_size()
        return x

    def _tp_sum(self, parts: Iterable[torch.Tensor]) -> torch.Tensor:
        (x,) = list(parts)                               # this rank's partial sum
        return self._allreduce(x) if self.tp > 1 else x

    def _embedding_collective(self, e: torch.Tensor) -> torch.Tensor:
        if self.tp == 1 or not self.cfg.get("use_parallel_embedding", False):
            return e                                     # replicated table: this rank looked every id up
        self._layer_now = "embedding"
        if int(self.cfg.get("embedding_sharding_dim", 0)) == 0:
            return self._allreduce(e)                    # masked lookups, summed
        parts = [torch.empty_like(e) for _ in range(self.tp)]
        dist.all_gather(parts, e.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _send_hidden(self, stage, hs):
        dst = self.rank + self.tp                        # Mapping.next_pp_rank
        for h in hs:
            h = h.contiguous()
            self.stats["handoff_s"] += self._timed(lambda: dist.send(h, dst=dst))
        return None                                      # this stage keeps nothing

    def _recv_hidden(self, stage, hs, batches):
        src = self.rank - self.tp                        # Mapping.prev_pp_rank
        out = []
        for b in batches:
            buf = torch.empty(*b.shape, self.H, dtype=torch.float32, device=self.device)
            self.stats["handoff_s"] += self._timed(lambda: dist.recv(buf, src=src))
            out.append(buf)
        return out

    def _final_logits(self, h, shape):
        """Rank 0 assembles ``[B, T, vocab]`` on the CPU from the last stage's shards (its own written in place);
        a last-stage rank sends its shard's shape, then the shard; other ranks return None."""
        lg = torch.empty(*shape, self.V, dtype=torch.float32) if self.rank == 0 else None
        col = 0
        for src in range((self.pp - 1) * self.tp, self.pp * self.tp):
            if src == self.rank == 0:
                col += self._head_into(lg, col, src, h)
            elif src == self.rank:
                buf = torch.empty(*h.shape[:2], self._shard_rows(), dtype=torch.float32, device=self.device)
                self._head_into(buf, 0, src, h)
                meta = torch.tensor(buf.shape, dtype=torch.int64, device=self.device)
                self.stats["gather_s"] += self._timed(lambda: (dist.send(meta, dst=0), dist.send(buf, dst=0)))
            elif self.rank == 0:
                meta = torch.empty(3, dtype=torch.int64, device=self.device)
                self.stats["gather_s"] += self._timed(lambda: dist.recv(meta, src=src))
                buf = torch.empty(*meta.tolist(), dtype=torch.float32, device=self.device)
                self.stats["gather_s"] += self._timed(lambda: dist.recv(buf, src=src))
                width = min(buf.shape[-1], self.V - col)  # the vocab padding is cut
                if width > 0:
                    lg[..., col:col + width] = buf[..., :width].cpu()
                col += buf.shape[-1]
        return lg

    def _shard_rows(self) -> int:
        """Rows of this rank's lm_head shard (the vocab_embedding's when lm_head is shared), from the header."""
        with self._open(self.rank) as f:
            name = "lm_head.weight" if "lm_head.weight" in set(f.keys()) else "transformer.vocab_embedding.weight"
            return f.get_slice(name).get_shape()[0]


# ---------------------------------------------------------------------------------------------- launching it
def launch(ckpt: str | Path, nproc: int, out: str | Path, *args: str, device: str = "auto", timeout_s: float = 600,
           threads_per_rank: int = 1, env: dict | None = None) -> dict:
    """Run this module under ``torchrun --standalone`` (its rendezvous picks a free port) and return rank 0's
    result.json. torchrun and its workers run in a session of their own, killed as a group on timeout and when
    done, so no worker outlives the call. Raises RuntimeError with the output's tail when the run fails."""
    import signal
    import subprocess
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pipeline.trtllm.distributed", str(ckpt), "--out", str(out), "--device", device,
           "--timeout", str(int(timeout_s)), *args]
    run_env = dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads_per_rank), FORGE_PROGRESS="0")
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), run_env.get("PYTHONPATH", "")) if p)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env, cwd=root,
                         start_new_session=True)
    try:
        so, se = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, se = p.communicate()
        raise RuntimeError(f"{' '.join(cmd)}: ran past {timeout_s:.0f} s\n{se[-4000:]}") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{so[-2000:]}\n{se[-6000:]}")
    return json.loads((Path(out) / "result.json").read_text())


# ---------------------------------------------------------------------------------------------- the entry point
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..host.cpu import cpu_model
    return f"cpu ({cpu_model()})"


def bench_allreduce(shape: tuple[int, ...], device: torch.device, group=None, iters: int = 20) -> dict:
    """Median seconds of one float32 ``all_reduce`` of ``shape`` (a layer's hidden state) after a barrier, and
    the bus bandwidth NCCL's tests report for it (2 (n - 1) / n x bytes / time)."""
    n = dist.get_world_size(group)
    x = torch.ones(shape, dtype=torch.float32, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(iters + 2):
        dist.barrier(group=group)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        if i >= 2:                                       # two warm-up calls (NCCL sets its channels up)
            times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    nbytes = x.numel() * 4
    return {"shape": list(shape), "bytes": nbytes, "ranks": n, "iters": iters, "median_s": med,
            "min_s": times[0], "busbw_gbs": round(2 * (n - 1) / n * nbytes / med / 1e9, 3)}


def _ids(args, vocab: int) -> torch.Tensor:
    if args.ids:
        return torch.load(args.ids).long()
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, min(vocab, 32000), (args.samples, args.seq_len), generator=g)


def _compare(ckpt: Path, batches, outs, device, kv_cache) -> dict:
    """The single-process reference over the same batches on ``device``; agreement with ``outs``."""
    from ..eval.metrics import LogitsComparer
    cmp, equal = LogitsComparer(), 0
    t0 = time.perf_counter()
    for b, ref, mine in zip(batches, ReferenceModel(ckpt, device=device, kv_cache=kv_cache).iter_logits(batches),
                            outs):
        cmp.update(ref, mine, b)
        equal += int(torch.equal(ref, mine))
    res = cmp.result()
    return {"single_process_wall_s": round(time.perf_counter() - t0, 3), "max_abs": res["logits_max_abs"],
            "top1_agreement": res["top1_agreement"], "logits_cosine": res["logits_cosine"],
            "ppl_single_process": res["ref_ppl"], "ppl_per_rank": res["ppl"], "batches_bit_identical": equal,
            "batches": res["windows"]}


def run(args) -> dict | None:
    """One rank's run; returns the result on rank 0 (None elsewhere)."""
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ckpt = Path(args.ckpt)
    model = DistributedReference(ckpt, device=device, kv_cache=args.kv_cache, resident=args.resident,
                                 threads=args.threads)
    ids = _ids(args, model.V)
    batches = [ids[i:i + args.batch] for i in range(0, ids.shape[0], args.batch)]
    dist.barrier()
    t0 = time.perf_counter()
    outs = [lg for lg in model.iter_logits(batches)]
    model._sync()
    wall = time.perf_counter() - t0
    by_layer = model.stats["allreduce_s_by_layer"]
    layers = [k for k in by_layer if k != "embedding"]
    mine = {"rank": rank, "stage": model.stage, "tp_rank": model.tp_rank, "pid": os.getpid(), "device": str(device),
            "device_name": _device_name(device), "wall_s": round(wall, 3),
            "rank_file_bytes": model.files[rank].stat().st_size, "peak_rss_bytes": process_peak_rss_bytes(),
            "allreduce_calls": model.stats["allreduce_calls"], "allreduce_bytes": model.stats["allreduce_bytes"],
            "allreduce_s_by_layer": by_layer,
            "allreduce_s_per_layer_mean": (sum(by_layer[k] for k in layers) / len(layers)) if layers else None,
            "handoff_s": model.stats["handoff_s"], "gather_s": model.stats["gather_s"]}
    if device.type == "cuda":
        mine.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(device),
                    resident_gpu_bytes=torch.cuda.memory_allocated(device),
                    peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved(device))
    group, tp, hidden = model.tp_group, model.tp, model.H
    del model
    bench = None
    if args.bench_allreduce and tp > 1:                 # each stage's TP group at once, as in the run
        bench = bench_allreduce((min(args.batch, ids.shape[0]), ids.shape[1], hidden), device, group)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    result = None
    if rank == 0:
        cfg = json.loads((ckpt / "config.json").read_text())
        m = cfg.get("mapping") or {}
        q = cfg.get("quantization") or {}
        result = {"label": LABEL + ", one rank per process", "checkpoint": str(ckpt),
                  "architecture": cfg.get("architecture"), "dtype": cfg.get("dtype"),
                  "quant_algo": q.get("quant_algo"), "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
                  "tp": int(m.get("tp_size", 1)), "pp": int(m.get("pp_size", 1)), "world": dist.get_world_size(),
                  "backend": dist.get_backend(), "torch": torch.__version__, "kv_cache_mode": args.kv_cache,
                  "resident": args.resident, "samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]),
                  "batch": args.batch, "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks,
                  "allreduce_bench": bench}
    if args.compare:
        if rank == 0:                                    # the other ranks wait at the barrier below
            result["compare"] = _compare(ckpt, batches, outs, device, args.kv_cache)
        dist.barrier()
    if rank == 0 and args.save_logits:
        torch.save(torch.cat(outs), Path(args.out) / "logits.pt")
    return result


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m pipeline.trtllm.distributed",
                                 description="checkpoint reference numerics, one rank per process")
    ap.add_argument("ckpt", help="TensorRT-LLM checkpoint directory (config.json + rank{N}.safetensors)")
    ap.add_argument("--out", required=True, help="directory for result.json (rank 0)")
    ap.add_argument("--ids", help="token ids [N, T] saved with torch.save (default: random ids, --seed)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2, help="windows per forward")
    ap.add_argument("--kv-cache", default="generation", choices=("generation", "context", "all"))
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto: cuda:LOCAL_RANK (NCCL) when there is a GPU per local rank, else cpu (gloo)")
    ap.add_argument("--resident", action="store_true", help="keep the rank's layers on its device (engine-like)")
    ap.add_argument("--compare", action="store_true", help="rank 0 also runs the single-process reference")
    ap.add_argument("--bench-allreduce", action="store_true", help="time a bare all_reduce of one hidden state")
    ap.add_argument("--save-logits", action="store_true")
    ap.add_argument("--threads", type=int, help="torch threads per process (torchrun sets OMP_NUM_THREADS=1)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a collective may wait for its peers")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("error: launch with torchrun, one process per rank: torchrun --standalone --nproc-per-node "
              "<tp x pp> -m pipeline.trtllm.distributed CKPT --out DIR", file=sys.stderr)
        return EXIT_ARGS
    if not (Path(args.ckpt) / "config.json").is_file():
        print(f"error: {args.ckpt}: no config.json (a TensorRT-LLM checkpoint directory is expected)",
              file=sys.stderr)
        return EXIT_ARGS
    local, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "cpu"
    if args.device == "cuda":
        if torch.cuda.device_count() <= local:
            print(f"error: local rank {local} but {torch.cuda.device_count()} GPUs visible (--device cpu runs "
                  f"every rank on the CPU with gloo)", file=sys.stderr)
            return EXIT_ARGS
        torch.cuda.set_device(local)
    os.environ.setdefault("FORGE_PROGRESS", "0")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    try:
        try:
            result = run(args)
        except (ValueError, FileNotFoundError, NotImplementedError) as e:
            print(f"error (rank {dist.get_rank()}): {e}", file=sys.stderr)
            return EXIT_ARGS
        if result is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=2))
            c = result.get("compare") or {}
            print(json.dumps({k: result[k] for k in ("tp", "pp", "world", "backend", "wall_s")} | {
                k: c[k] for k in ("max_abs", "top1_agreement", "logits_cosine") if k in c}))
        dist.barrier()                                   # everyone is done before anyone tears down
        return EXIT_OK
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization: after a completed run and destroy_process_group, a gloo rank
    # still died in it about one run in ten on our 2-core machine ("terminate called without an active exception",
    # SIGABRT, printed after atexit handlers ran), which torchrun reports as a failed run. Results are written
    # and streams flushed by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
