"""A session that trains: the validated config on its devices (jaxpar.session.Session) and the run's
inputs, each read once when first used: the training and validation rows (windows, packed rows, a
mixture's), or GRPO's prompts, and GRPO's reward. `prepare` reads them all before anything compiles,
so that a missing data.source, checkpoint or reward is one sentence then."""

from __future__ import annotations

import dataclasses
import functools

from jaxpar.config import Config
from jaxpar.config.objectives import objective_of
from jaxpar.data.corpus import load_tokens, split_tokens
from jaxpar.data.loader import BatchSampler
from jaxpar.data.mixture import mixture_samplers
from jaxpar.data.packing import packed_samplers
from jaxpar.data.preference import check_preference_source
from jaxpar.data.token_folder import has_loss_mask
from jaxpar.errors import DataError
from jaxpar.rl.prompts import PromptSet
from jaxpar.rl.rewards import Reward, load_reward
from jaxpar.runtime.devices import setup_devices
from jaxpar.session import Session, on_devices


@dataclasses.dataclass(frozen=True)
class RunSession(Session):
    """A Session with the run's inputs: train_data, val_data (None for GRPO) and reward."""

    @functools.cached_property
    def _samplers(self) -> tuple:
        m, t, d = self.cfg.model, self.cfg.train, self.cfg.data
        objective = objective_of(self.cfg)
        if objective.samples:  # prompts, sampled and scored every step: no held-out windows
            return PromptSet.load(self.cfg, self.codec), None
        check_preference_source(d, objective)  # pairs for a preference objective, and only for one
        if self.mixture:
            return mixture_samplers(self.mixture, d, m, t)
        if d.packing != "none":
            return packed_samplers(d, m, t)
        if has_loss_mask(d.source):
            raise DataError(f"data.source '{d.source}' was tokenized with --sft or --chat, and data.packing=none would "
                            f"put the prompts in the loss too; train it with data.packing=pack (or concat).")
        train_tokens, val_tokens = split_tokens(load_tokens(d.source, m.vocab_size), d.val_fraction, m.seq_len)
        return (BatchSampler(train_tokens, m.seq_len, t.batch_size, t.seed),
                BatchSampler(val_tokens, m.seq_len, t.batch_size, t.seed))

    @functools.cached_property
    def reward(self) -> Reward | None:
        """train.objective=grpo's reward function (jaxpar.rl.rewards), imported and checked; else None."""
        return load_reward(self.cfg.rl) if objective_of(self.cfg).samples else None

    @property
    def train_data(self):
        """The training rows: a BatchSampler of windows, or a sampler of packed rows (data.packing)."""
        return self._samplers[0]

    @property
    def val_data(self):
        return self._samplers[1]


def prepare(cfg: Config, devices: list | None = None) -> RunSession:
    """Set up devices (emulated on CPU) unless given, validate the config, derive its mesh and read the
    run's inputs; raises UserError."""
    session = on_devices(cfg, devices or setup_devices(cfg))
    run = RunSession(**{field.name: getattr(session, field.name) for field in dataclasses.fields(Session)})
    run.train_data  # noqa: B018 (a missing or unreadable data.source is reported before compiling)
    run.hf_checkpoint  # noqa: B018 (so is a missing, cut-short or misshapen model.from_hf checkpoint)
    run.reward  # noqa: B018 (and a GRPO reward that cannot be imported)
    return run
