"""CUDA graphs for the engine's decode step: captured once per key, replayed, or off for the process.

    graphs = cudagraphs.StepGraphs(device)       # one per generate call: its graphs share a memory pool
    graphs.run(key, step)                        # step() run once, captured under `key`; replayed after
    with cudagraphs.on_device(device): ...       # `device` current for the duration (CUDA only)

What it decides, and why:
- `step` is a function of buffers written in place (no argument, no result, no host read), so a
  graph of it replays the same work on new data. The first `run` of a key runs `step` on a side
  stream (lazy set-ups happen outside the capture) and captures it; that run is the step's own
  execution (a capture records, it does not execute). Later runs of the key replay the graph.
- every call to `torch.cuda` names the model's device, and a capture runs with that device
  current: a stream or capture on the current device while the model sits on another one (a
  `--device cuda:1` run outside torchrun) records nothing, and an empty graph replays as a no-op
  (stale logits, no K/V written) with only a warning from PyTorch.
- the first capture that fails turns graphs off for the whole process (`GRAPHS["refused"]`, its
  first exception, printed once): every later step runs eagerly rather than retrying a capture
  that fails the same way at every call. The step that failed already ran (its warm-up).
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

# What the decode graphs did in this process: generate calls, graphs captured, steps replayed,
# steps run eagerly, the wall time of the captures (their warm-up step included), and the first
# capture failure ("" if none; once set, graphs stay off).
GRAPHS = {"calls": 0, "captures": 0, "replays": 0, "eager_steps": 0, "capture_s": 0.0, "refused": ""}


def graphs_line() -> str:
    """One line of GRAPHS: whether decode steps replayed graphs or ran eagerly (and why)."""
    g = GRAPHS
    why = f"; graphs refused: {g['refused']}" if g["refused"] else ""
    each = (f", {(g['replays'] + g['captures']) / g['captures']:.0f} steps per capture, "
            f"{g['capture_s']:.1f} s capturing" if g["captures"] else "")
    return (f"{g['calls']} generate calls, {g['captures']} graph captures ({g['captures'] / max(g['calls'], 1):.1f} "
            f"per call{each}), {g['replays']} steps replayed, {g['eager_steps']} eager{why}")


def usable(device) -> bool:
    """Whether decode steps on `device` may be captured: a CUDA device, and no capture has failed
    in this process."""
    return torch.device(device).type == "cuda" and not GRAPHS["refused"]


def on_device(device):
    """A context in which `device` is the current CUDA device (nothing elsewhere)."""
    device = torch.device(device)
    return cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def first_cause(e: BaseException) -> BaseException:
    """The exception that started a chain: a capture that fails inside `torch.cuda.graph` raises
    again when the capture is ended, and that second error names only the capture."""
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    return e


class StepGraphs:
    """The graphs of one generate call, keyed by whatever fixes a step's shapes."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.graphs, self.pool = {}, None
        self.captures = self.replays = self.eager_steps = 0
        self.capture_s = 0.0

    def run(self, key, step) -> None:
        """Replay key's graph; else run step() and capture it; eagerly once graphs are off."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        if GRAPHS["refused"]:
            step()
            self.eager_steps += 1
            return
        t = time.perf_counter()
        graph = self._capture(step)
        self.capture_s += time.perf_counter() - t
        if graph is None:
            self.eager_steps += 1
        else:
            self.graphs[key] = graph
            self.captures += 1

    def _capture(self, step):
        """Run step() on a side stream, then capture it into a graph sharing the call's memory
        pool, with the device current; None if the capture fails (graphs are then off)."""
        dev = self.device
        with on_device(dev):
            side = cuda.Stream(device=dev)
            side.wait_stream(cuda.current_stream(dev))
            with cuda.stream(side):
                step()                                   # the step's execution: a capture only records
            cuda.current_stream(dev).wait_stream(side)
            try:
                graph = cuda.CUDAGraph()
                with cuda.graph(graph, pool=self.pool, stream=side):
                    step()
                self.pool = graph.pool()
                return graph
            except Exception as e:  # noqa: BLE001 - any failure: decode eagerly from now on
                cause = first_cause(e)
                GRAPHS["refused"] = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
                print(f"engine: no CUDA graphs for the rest of this process ({GRAPHS['refused']}); "
                      "decoding eagerly", file=sys.stderr)
                cuda.synchronize(dev)
                return None

    def count(self) -> None:
        """Add this call's captures, replays and eager steps to GRAPHS."""
        GRAPHS["calls"] += 1
        GRAPHS["captures"] += self.captures
        GRAPHS["replays"] += self.replays
        GRAPHS["eager_steps"] += self.eager_steps
        GRAPHS["capture_s"] += self.capture_s
