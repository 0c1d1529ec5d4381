"""Evaluation: the `dlm-studio` model of lm-evaluation-harness (`lm_eval_model`, imported only by `dlm-studio
lm-eval`: lm-eval is an optional dependency)."""
