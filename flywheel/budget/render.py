"""The table ``flywheel budget`` prints: a :func:`flywheel.budget.estimate.budget_report` as rich text."""

from __future__ import annotations

from flywheel.budget.trajectories import EVAL, TRAIN


def _r(d: dict) -> dict:
    """``d`` with its numbers rounded to 3 places (for printing)."""
    return {k: None if v is None else round(v, 3) for k, v in d.items()}


def render(report: dict, console) -> None:
    """Print ``report`` (:func:`budget_report`) as a rich table, with its source and the range."""
    from rich.console import Console
    from rich.table import Table

    def f(v, nd=0):
        return "-" if v is None else f"{v:,.{nd}f}"

    t = Table(title=f"flywheel budget {report.get('config', '')}: {report['method']}")
    for col in ("domain", "split", "trajectories", "re-samples", "rounds", "tokens/round", "tokens/traj",
                "generated tokens", "tool rounds", "sandbox s", "judge calls"):
        t.add_column(col, justify="left" if col in ("domain", "split") else "right", no_wrap=True)
    for r in report["estimate"]["rows"]:
        t.add_row(r["domain"], r["split"], f(r["trajectories"]), f(r.get("resample_trajectories")),
                  f(r["rounds"], 2), f(r["tokens_per_round"], 1), f(r["tokens_per_trajectory"], 1),
                  f(r["generated_tokens"]), f(r["tool_rounds"]), f(r["sandbox_seconds"], 1), f(r["judge_calls"]))
    for name, tot in (("train", report["estimate"]["by_split"][TRAIN]), ("eval", report["estimate"]["by_split"][EVAL]),
                      ("total", report["estimate"]["total"])):
        t.add_row(f"[bold]{name}", "", f(tot["trajectories"]), "", "", "", "", f"[bold]{f(tot['generated_tokens'])}",
                  f(tot["tool_rounds"]), f(tot["sandbox_seconds"], 1), f(tot["judge_calls"]))
    # every column in full, also when not on a terminal (80 columns then)
    Console(file=console.file, width=max(console.width, 160), force_terminal=console.is_terminal,
            no_color=console.no_color, soft_wrap=False).print(t)
    p = report["plan"]
    console.print(f"plan: {p['training_groups']} training groups ({p['max_steps']} steps x {p['groups_per_step']}), "
                  f"eval rounds at versions {p['eval_round_versions']}, re-samples of {p['resample_unsolved']}")
    if "range" in report:
        rg = report["range"]
        console.print(f"range: {f(rg['learned']['generated_tokens'])} generated tokens if the policy were the rewarded "
                      f"one from the start .. {f(rg['no_learning']['generated_tokens'])} if it stayed at version 0")
    if report.get("pilot"):
        pl = report["pilot"]
        console.print(f"pilot: {pl['tasks']} tasks, K={pl['samples_per_task']}, {pl['seconds']:.1f} s "
                      f"(model load {pl['load_seconds']:.1f} s); unsolved share at version 0 {_r(pl['unsolved'])}, "
                      f"never solved {_r(pl['never_solved'])}, over the run {_r(report.get('learning', {}).get('unsolved_over_run', {}))}")
    if report.get("history"):
        console.print(f"history: {report['history']['path']} ({report['history']['source']})")
    for n in report.get("notes", []):
        console.print(f"[yellow]note[/]: {n}")
