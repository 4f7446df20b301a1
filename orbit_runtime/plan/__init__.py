"""The memory planner behind `orbit plan`: will an RL job fit one node, and with which layout?

Pure arithmetic on a model's config.json and the job spec (no torch, no transformers), so the
operator can plan a job at admission. architecture -> parameters -> weights, activations,
roles -> layouts -> planner (make_plan), job_fit (a pod as a job asks for it), report, compare.
"""
