"""The proposer a speculative config asks for; both implement core.proposer.Proposer."""
from __future__ import annotations

from twostep.config import EngineConfig
from twostep.core.execution.model_builder import ModelInstance
from twostep.core.scheduling.proposer import Proposer
from twostep.platforms import Platform
from twostep.sample.sampler import Sampler
from twostep.spec_decode.draft_model import DraftModelProposer
from twostep.spec_decode.ngram import NgramProposer


def make_proposer(config: EngineConfig, target: ModelInstance, platform: Platform,
                  sampler: Sampler) -> Proposer:
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec)
    return DraftModelProposer(spec, config, target, platform, sampler)
