"""The rulebook: what a job may combine, decided once (see :mod:`mtds.rules.book`)."""
from mtds.rules.book import (ALL_RULES, PARTITION_RULES, RULES, Rule, check, check_shards, markdown_table, only,
                             problems)
from mtds.rules.job import EVAL, TRAIN, Job, ModelFacts
from mtds.rules.problem import CANNOT, NOT_BUILT, JobRefused, Problem

__all__ = ["ALL_RULES", "CANNOT", "EVAL", "NOT_BUILT", "PARTITION_RULES", "RULES", "TRAIN", "Job", "JobRefused",
           "ModelFacts", "Problem", "Rule", "check", "check_shards", "markdown_table", "only", "problems"]
