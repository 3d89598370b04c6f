"""Reinforcement learning from verifiable rewards (train.objective = grpo): the reward functions that score
each sampled completion of a prompt (jaxpar.rl.rewards) and the rollouts that sample them
(jaxpar.rl.rollout); the loss the step takes from their group-normalised advantages is in jaxpar.rl.grpo
and the settings in the rl section (jaxpar.config.rl)."""
