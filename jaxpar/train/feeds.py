"""What each training step takes: the next batch of windows or packed rows from the data (`WindowFeed`),
or for train.objective=grpo a batch of completions sampled from the current weights and scored
(`RolloutFeed`, jaxpar.rl.rollout), each with what the host knows of it for the step's metrics line."""

from __future__ import annotations

from jaxpar.config.objectives import objective_of
from jaxpar.rl.rollout import Rollouts, Scoring
from jaxpar.sampling.command import stop_ids
from jaxpar.session import Session
from jaxpar.train.trainer import Trainer


class WindowFeed:
    """The data's batch of step `index`, and for packed rows their packing efficiency (and a mixture's
    shares)."""

    def __init__(self, session: Session, trainer: Trainer):
        self.session, self.trainer = session, trainer
        self.packed = session.cfg.data.packing != "none"

    def batch(self, index: int, state) -> tuple:
        sampler = self.session.train_data
        starts = sampler.starts(index)
        return self.trainer.put_windows(sampler, starts), (self.rows(starts) if self.packed else None)

    def rows(self, starts) -> dict:
        sampler = self.session.train_data
        mixture = self.session.mixture
        shares = {f"share/{name}": v for name, v in sampler.shares(starts).items()} if mixture else {}
        return {"packing_efficiency": sampler.efficiency(starts), **shares}


class RolloutFeed:
    """Step `index` trains on rollout index // rl.updates_per_batch, sampled from the weights of its first
    step and kept for the others. Its metrics: the rewards' mean and spread, the completions' mean length
    and the seconds spent sampling (generate_s, on the step that sampled)."""

    def __init__(self, session: Session, trainer: Trainer):
        cfg = session.cfg
        self.updates = cfg.rl.updates_per_batch
        self.rollouts = Rollouts(session, trainer, session.train_data, session.reward, session.codec,
                                 stop_ids(session.tokenizer))
        # the reference policy: the adapters off (nothing kept), else the weights the run started from
        frozen = None if cfg.model.lora.enabled or cfg.rl.kl_beta == 0 else trainer.start_params()
        self.scoring = Scoring(trainer, frozen)
        self._kept: tuple | None = None

    def sample(self, index: int, state):
        """(rollout number, its Rollout, its scored batch or None) for step `index`, sampled now if this is
        the rollout's first step."""
        rollout = index // self.updates
        if self._kept is None or self._kept[0] != rollout:
            self._kept = (rollout, self.rollouts.sample(rollout, state.params), None)
        return self._kept

    @property
    def rows(self):
        """The host rows of the rollout last sampled (verify replays them to its reference)."""
        return self._kept[1].rows

    def batch(self, index: int, state) -> tuple:
        rollout, sampled, scored = self.sample(index, state)
        fresh = scored is None
        if fresh:
            scored = self.scoring.batch(state.params, sampled.rows)
            self._kept = (rollout, sampled, scored)
        return scored, {**sampled.metrics, "generate_s": sampled.metrics["generate_s"] if fresh else 0.0}


def feed_for(session: Session, trainer: Trainer):
    """The step's batches for this run's objective."""
    return RolloutFeed(session, trainer) if objective_of(session.cfg).samples else WindowFeed(session, trainer)
