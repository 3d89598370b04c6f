"""Evaluating models with EleutherAI's lm-evaluation-harness, an optional extra (pip install 'jaxpar[eval]'):
scoring.py log-likelihoods on a layout, harness.py lm-eval's LM interface, tasks.py which tasks and running
them, command.py `jaxpar eval` and evaluate_model, in_loop.py train.eval_tasks. in_loop.py (which imports
the others only for a run that names tasks) imports without lm-eval installed; the task names a config
gives, and when they run, are read in jaxpar.features.evals."""
