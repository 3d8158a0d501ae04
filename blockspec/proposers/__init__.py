"""Proposers: what makes a step's drafts. One file a kind, behind `base.Proposer`; a drafter kind
(`blockspec.models.registry.DrafterKind`) names its proposer here."""

from blockspec.proposers.dflash import DFlashProposer

DRAFTER_PROPOSERS = {"dflash": DFlashProposer}  # a drafter's `proposer` name -> the class made from it
