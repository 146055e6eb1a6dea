"""AdamW against Muon, and warmup-stable-decay against cosine, on the `small` preset on CPU
(issue 41's "does it pay?"): each optimizer at the best learning rate of a short sweep,
then the better of the two under wsd at the same tokens. Writes the numbers as JSON and
the curves as an SVG for docs/optimizers.md:

    .venv/bin/python scripts/optimizer_comparison.py            # ~15 min on 2 cores
    .venv/bin/python scripts/optimizer_comparison.py --steps 40 --lrs 3e-3   # a quick look

Every run: the default corpus (the Python standard library, held-out documents for the
evaluation: 3% of them), sequences of 256, 8 per step (2,048 tokens), linear warmup over a tenth of the
steps, the eval loss on 8 x 8 held-out sequences at the end. The sweep ranks by that eval
loss; the curves are the training loss, a moving mean over 10 steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(run: Path, steps: int, optimizer: str, lr: float, schedule: str) -> dict:
    args = [
        "model.preset=small", "data.seq_len=256", "train.micro_batch=8", f"train.steps={steps}",
        f"train.warmup_steps={max(1, steps // 10)}", f"train.lr={lr}", f"train.optimizer={optimizer}",
        f"train.schedule={schedule}", f"eval.every={steps}", "eval.batches=8", "eval.split=0.03", "train.log_every=10",
        "checkpoint.every=0", f"run.dir={run}", "run.device=cpu",
    ]  # fmt: skip
    if not (run / "metrics.jsonl").exists() or _rows(run, "eval") == []:
        subprocess.run([sys.executable, "-m", "scaletrain", "train", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    steps_rows = _rows(run, None)
    return {
        "optimizer": optimizer,
        "lr": lr,
        "schedule": schedule,
        "eval_loss": _rows(run, "eval")[-1]["loss"],
        "losses": [r["loss"] for r in steps_rows],
        "seconds": sum(r["step_time_s"] for r in steps_rows),
    }


def _rows(run: Path, event: str | None) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == event]


def smooth(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def plot(best: dict[str, dict], wsd: dict, cosine: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    for name, r in best.items():
        left.plot(range(1, len(r["losses"]) + 1), smooth(r["losses"]), label=f"{name}, lr {r['lr']:g}: eval {r['eval_loss']:.3f}")
    left.set(title="AdamW vs Muon, each at its best swept lr (cosine)", xlabel="step (2,048 tokens each)", ylabel="training loss")
    for label, r in (("cosine", cosine), ("wsd (1-sqrt decay, last fifth)", wsd)):
        right.plot(range(1, len(r["losses"]) + 1), smooth(r["losses"]), label=f"{label}: eval {r['eval_loss']:.3f}")
    right.set(
        title=f"{cosine['optimizer']} at lr {cosine['lr']:g}: schedules at equal tokens", xlabel="step", ylabel="training loss"
    )
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(top=min(8.5, max(ax.get_ylim()[1], 0)))
    fig.tight_layout()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "optimizers"}):
        fig.savefig(out, format="svg", metadata={"Date": None})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "optimizer-comparison")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "optimizer-comparison.json")
    parser.add_argument("--svg", type=Path, default=ROOT / "docs" / "img" / "optimizer-comparison.svg")
    a = parser.parse_args()
    sweep = []
    for optimizer in ("adamw", "muon"):
        for lr in a.lrs:
            r = train(a.work / f"{optimizer}-{lr:g}-cosine", a.steps, optimizer, lr, "cosine")
            print(f"{optimizer} lr {lr:g} cosine: eval loss {r['eval_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
            sweep.append(r)
    best = {o: min((r for r in sweep if r["optimizer"] == o), key=lambda r: r["eval_loss"]) for o in ("adamw", "muon")}
    for r in best.values():
        if len(a.lrs) > 1 and r["lr"] in (min(a.lrs), max(a.lrs)):
            print(f"note: {r['optimizer']}'s best lr {r['lr']:g} is at the edge of the sweep: widen --lrs", flush=True)
    winner = min(best.values(), key=lambda r: r["eval_loss"])
    wsd = train(a.work / f"{winner['optimizer']}-{winner['lr']:g}-wsd", a.steps, winner["optimizer"], winner["lr"], "wsd")
    print(f"{winner['optimizer']} lr {winner['lr']:g} wsd: eval loss {wsd['eval_loss']:.4f}", flush=True)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.svg.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "steps": a.steps,
        "tokens_per_step": 2048,
        "sweep": [{k: r[k] for k in ("optimizer", "lr", "schedule", "eval_loss", "seconds")} for r in sweep],
        "wsd": {k: wsd[k] for k in ("optimizer", "lr", "schedule", "eval_loss", "seconds")},
    }
    a.json.write_text(json.dumps(summary, indent=1) + "\n")
    plot(best, wsd, winner, a.svg)
    print(f"wrote {a.json} and {a.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
