"""``flywheel budget``: what a run will generate, estimated before it starts.

The estimate is the seeds' formula, per domain and split (train / eval)::

    generated tokens = trajectories × rounds per trajectory × generated tokens per round

plus tool rounds, tool seconds, sandbox seconds (unit tests in the verifier) and judge calls where the
domain's tasks use them (each a per-trajectory mean times the trajectories).

*Trajectories* come from the config alone (:func:`~flywheel.budget.trajectories.plan_counts`):

- training: ``max_steps × ⌈batch_groups × oversample⌉`` groups (the sampler's issue budget,
  :func:`scheduler_service.issue_loop.training_budget` summed over the run) × ``samples_per_task``, shared
  between domains by their ``domains.<d>.weight`` (default 1, paused or retired domains 0), plus the
  expected re-samples: each group that comes back unsolved (no sample passed) is followed by one group
  of ``budget.resample_unsolved`` samples when that is larger than K (:func:`shared.groups.resample_wanted`);
  the unsolved fraction is the mean over tasks of ``(1 − p)^K`` (:func:`unsolved_probability`);
- evaluation: held-out tasks × eval rounds (:func:`eval_round_versions`: round 0 when
  ``eval_before_training``, one per ``eval_every`` multiple up to ``max_steps``, and the final round
  ``flywheel run`` creates at ``max_steps`` when none falls there).

*Per-trajectory costs* come from a short pilot (:func:`run_pilot`: the config's model with the rollout's
engine settings, K samples of a few training tasks at the config's temperature and ``max_tokens``, one
greedy sample of a few held-out tasks, scored in-process by the verifier's :class:`Scorer`), or from a
finished run's report (:func:`history_costs`, ``flywheel run --report``).

The pilot measures the policy at version 0, and training moves it: a task whose reward favours short
answers gets shorter completions (longer ones the other way round), held-out greedy lengths follow, and
the tasks the policy learns need no more re-samples. With the pilot alone the estimate assumes *even-pace
learning* (:func:`_pilot_estimates`) towards the rewarded policy, the one that answers like the pilot's
passing samples (the optimum of a 0/1 reward under a KL penalty β, π* ∝ π₀·exp(r/β), is nearly π₀
conditioned on passing for β ≪ 1): sampled lengths move at an even pace from the version-0 mean to the
passing samples' mean (:attr:`Cost.pass_tokens`) and greedy ones to the length of the most probable
passing answer (:func:`greedy_target`: greedy decoding returns the most probable sequence), each kind of
trajectory costed at its mean progress through the run (training groups ½, an eval round at version v at
v / max_steps). The pilot re-samples its unsolved groups as the run does; a task that passes in neither
group stays unsolved over the run (an all-fail group has zero advantage, so nothing in the run teaches
it), the others are learned at the same even pace (unsolved share over the run (1 − p₀)^K / (K + 1)).
``range`` gives the two ends: ``no_learning`` (the version-0 policy throughout, an upper bound where
lengths shrink) and ``learned`` (the rewarded policy from the start, no re-samples). A finished run's
report (``--history``) replaces the model with what that run measured.

The package: :mod:`~flywheel.budget.trajectories` (trajectories from the config alone),
:mod:`~flywheel.budget.costs` (per-trajectory costs, and those of a finished run's report),
:mod:`~flywheel.budget.pilot` (the pilot), :mod:`~flywheel.budget.estimate` (the estimate and its learning
model) and :mod:`~flywheel.budget.render` (the table ``flywheel budget`` prints).
"""
