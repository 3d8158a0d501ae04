"""Proposers: what makes a step's drafts. One file a kind, behind `base.Proposer`; a drafter kind
(`blockspec.models.registry.DrafterKind`) names its proposer here."""

from blockspec.proposers.dflash import DFlashProposer
from blockspec.proposers.dflash2 import DFlash2Proposer
from blockspec.proposers.dspark import DSparkProposer

DRAFTER_PROPOSERS = {  # a drafter's `proposer` name -> the class made from it
    "dflash": DFlashProposer,
    "dflash2": DFlash2Proposer,
    "dspark": DSparkProposer,
}
