"""The proposer a speculative config asks for; each implements core.proposer.Proposer (the MTP one
HiddenStateProposer: it drafts from the target's hidden states)."""
from __future__ import annotations

from twostep.config import EngineConfig
from twostep.core.execution.model_builder import ModelInstance
from twostep.core.scheduling.proposer import Proposer
from twostep.platforms import Platform
from twostep.sample.sampler import Sampler
from twostep.spec_decode.draft_model import DraftModelProposer
from twostep.spec_decode.mtp import MTPProposer
from twostep.spec_decode.ngram import NgramProposer


def make_proposer(config: EngineConfig, target: ModelInstance, platform: Platform,
                  sampler: Sampler) -> Proposer:
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "mtp":
        return MTPProposer(spec, config, target, platform, sampler)
    return DraftModelProposer(spec, config, target, platform, sampler)
