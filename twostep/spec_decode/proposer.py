"""The proposer a speculative config asks for. Both kinds answer propose(requests, ks) with
(draft tokens, their draft distributions or None) per request, and remove(request_id)."""
from __future__ import annotations

from twostep.core.sampler import Sampler
from twostep.spec_decode.config import SpeculativeConfig
from twostep.spec_decode.draft_model import DraftModelProposer, TargetShape
from twostep.spec_decode.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, target: TargetShape, sampler: Sampler):
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(config, target, sampler)
