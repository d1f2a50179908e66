"""CUDA graphs for the engine's decode step: captured once per key and process, in pieces around
eager holes, replayed; off for the process after a capture fails twice.

    graphs = cudagraphs.StepGraphs(device)       # the engine keeps one per device and weights
    graphs.run(key, step)                        # step() captured under `key` and replayed, then replayed
    out = cudagraphs.hole(fn)                    # inside step: fn() eagerly, between two captured pieces
    with cudagraphs.on_device(device): ...       # `device` current for the duration (CUDA only)

What it decides, and why:
- `step` is a function of buffers written in place (no argument, no result, no host read), so a
  graph of it replays the same work on new data, and run twice on the same buffers it writes the
  same (the engine's forward does; a step that advanced a counter would not). The first `run` of
  a key runs `step` on a side stream (lazy set-ups happen outside the capture), captures it and
  replays it once: that replay is the step's execution. A capture records the pieces' kernels
  and runs none of them, while the holes between them do run, on what the pieces have not
  computed: the engine's hole writes garbage K/V at the step's columns, which the replay writes
  again (so does an eager step after a capture that failed). Later runs of the key replay it.
- a step is captured in pieces: where it calls `hole(fn)`, the piece so far is ended, fn() runs
  eagerly, and a new piece begins; a replay runs piece, hole, piece, ..., each hole's result
  copied into the tensor it gave at capture (unless it wrote there), which the next piece reads.
  The engine's hole is each layer's paged attention, whose shapes change every step (the pages
  its rows hold), so the rest of the step (every weight, ~95% of its kernels) is one graph per
  row bucket, kept for the process, the way vLLM's piecewise graphs leave attention out. A
  graph keeps what its holes read and return for its life: the engine's are views of buffers
  kept once for all row buckets (engine._Slots.stage), not tensors of each bucket's own.
- every call to `torch.cuda` names the model's device, and a capture runs with that device
  current: a stream or capture on the current device while the model sits on another one (a
  `--device cuda:1` run outside torchrun) records nothing, and an empty graph replays as a no-op
  (stale logits, no K/V written) with only a warning from PyTorch.
- a capture that fails is tried once more (GRAPHS["failures"] counts both); a second failure
  turns graphs off for the whole process (`GRAPHS["refused"]`, its first exception, printed
  once to stderr and, through `graphs_status`, in train.py's step line and metrics.jsonl): every
  later step runs eagerly, several times slower, so a run must say so where it is read.
- `cuda`, the module every call goes through, is `torch.cuda`; tests put a stand-in there to
  check on a CPU what the engine asks of it (tests/test_cudagraphs.py).
GRAPHS counts what happened in this process, and `graphs_line` says it in one line for the bench
scripts.
"""
import contextlib
import sys
import time

import torch

cuda = torch.cuda   # every CUDA call goes through this name (a test's stand-in replaces it)

# What the decode graphs did in this process: generate calls, graphs captured (one a key), steps
# replayed, steps run eagerly, the wall time of the captures (their warm-up step included),
# captures that failed, and the first failure that turned graphs off ("" if none).
GRAPHS = {"calls": 0, "captures": 0, "replays": 0, "eager_steps": 0, "capture_s": 0.0, "failures": 0,
          "refused": ""}
_CAPTURING = []   # the capture in progress, for `hole`


def graphs_line() -> str:
    """One line of GRAPHS: whether decode steps replayed graphs or ran eagerly (and why)."""
    g = GRAPHS
    why = f"; graphs refused: {g['refused']}" if g["refused"] else ""
    failed = f", {g['failures']} failed" if g["failures"] else ""
    each = (f", {(g['replays'] + g['captures']) / g['captures']:.0f} steps per capture, "
            f"{g['capture_s']:.1f} s capturing" if g["captures"] else "")
    return (f"{g['calls']} generate calls, {g['captures']} graph captures{failed} "
            f"({g['captures'] / max(g['calls'], 1):.1f} per call{each}), {g['replays']} steps replayed, "
            f"{g['eager_steps']} eager{why}")


def graphs_status() -> str:
    """'' while graphs work or were never tried; else what a run's step line and metrics.jsonl
    say: the failed captures and whether graphs are off for the process."""
    g = GRAPHS
    if g["refused"]:
        return f"off ({g['refused']})"
    return f"{g['failures']} failed captures" if g["failures"] else ""


def usable(device) -> bool:
    """Whether decode steps on `device` may be captured: a CUDA device, and graphs not turned off
    in this process."""
    return torch.device(device).type == "cuda" and not GRAPHS["refused"]


def on_device(device):
    """A context in which `device` is the current CUDA device (nothing elsewhere)."""
    device = torch.device(device)
    return cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def first_cause(e: BaseException) -> BaseException:
    """The exception that started a chain: a capture that fails inside a capture raises again
    when the capture is ended, and that second error names only the capture."""
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    return e


def hole(fn):
    """fn()'s result: run eagerly now, and while a step is being captured, recorded between two
    pieces so that every replay runs it there again (its result copied into the tensor returned
    now, which the pieces after it read). fn must read only tensors made before it (in place
    later) and objects it looks up when called."""
    return _CAPTURING[-1].hole(fn) if _CAPTURING else fn()


class _Pieces:
    """A step captured as graphs with eager holes between them (see `hole`)."""

    def __init__(self, pool):
        self.pool, self.graphs, self.holes = pool, [], []

    def begin(self) -> None:
        g = cuda.CUDAGraph()
        self.graphs.append(g)
        g.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graphs[-1].capture_end()
        if self.pool is None:
            self.pool = self.graphs[-1].pool()   # later pieces and keys share the first's memory pool

    def hole(self, fn):
        self.end()
        out = fn()
        self.holes.append((fn, out))
        self.begin()
        return out

    def replay(self) -> None:
        for i, g in enumerate(self.graphs):
            g.replay()
            if i < len(self.holes):
                fn, out = self.holes[i]
                res = fn()
                if res.data_ptr() != out.data_ptr():   # a hole that writes its result in place needs no copy
                    out.copy_(res)


class StepGraphs:
    """The decode graphs of one device and one set of weights, keyed by what fixes a step's
    shapes (the engine's row bucket); kept by the engine across generate calls."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.graphs, self.pool, self.cause = {}, None, ""

    def run(self, key, step) -> None:
        """Replay key's graph; else run step() and capture it (twice at most); eagerly once graphs
        are off."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            GRAPHS["replays"] += 1
            return
        if GRAPHS["refused"]:
            step()
            GRAPHS["eager_steps"] += 1
            return
        t = time.perf_counter()
        graph = self._capture(step, warm=True) or self._capture(step, warm=False)   # a failure: once more
        if graph is None:
            GRAPHS["refused"] = self.cause
            print(f"engine: no CUDA graphs for the rest of this process ({self.cause}); decoding eagerly",
                  file=sys.stderr)
            step()                     # the failed captures' holes may have written: the step again
            GRAPHS["eager_steps"] += 1
        else:
            self.graphs[key] = graph
            with on_device(self.device):
                graph.replay()         # the step's execution, over what the capture's holes wrote
            GRAPHS["captures"] += 1
        GRAPHS["capture_s"] += time.perf_counter() - t

    def _capture(self, step, warm: bool):
        """Run step() on a side stream (`warm`: for the lazy set-ups; a second try needs none),
        then capture it in pieces sharing the memory pool of these graphs, with the device
        current. None if the capture fails (counted, its first cause kept in self.cause)."""
        dev = self.device
        with on_device(dev):
            side = cuda.Stream(device=dev)
            side.wait_stream(cuda.current_stream(dev))
            with cuda.stream(side):
                if warm:
                    step()                               # lazy set-ups happen here, not in the capture
                cuda.synchronize(dev)
                pieces = _Pieces(self.pool)
                _CAPTURING.append(pieces)
                try:
                    pieces.begin()
                    step()
                    pieces.end()
                except Exception as e:  # noqa: BLE001 - any failure: try once more, then decode eagerly
                    with contextlib.suppress(Exception):
                        pieces.graphs[-1].capture_end()  # a capture left open would poison the stream
                    cause = first_cause(e)
                    self.cause = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
                    GRAPHS["failures"] += 1
                    cuda.synchronize(dev)
                    return None
                finally:
                    _CAPTURING.pop()
            cuda.current_stream(dev).wait_stream(side)
            self.pool = pieces.pool
            return pieces
