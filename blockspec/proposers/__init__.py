"""Proposers: what makes a step's drafts. One file a kind, behind `base.Proposer`; a drafter kind
(`blockspec.models.registry.DrafterKind`) names its proposer here."""

from blockspec.proposers.dflash import DFlashProposer
from blockspec.proposers.dspark import DSparkProposer

DRAFTER_PROPOSERS = {
    "dflash": DFlashProposer,
    "dspark": DSparkProposer,
}  # a drafter's `proposer` name -> the class made from it
