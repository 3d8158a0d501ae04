"""Proposers: what makes a step's drafts. One file a kind, behind `base.Proposer`."""
