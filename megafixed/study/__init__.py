"""The three-interface study (``megafixed study``) and the input probe (``megafixed probe``).

* ``plan``: the runs of a study -- grid point x interface x seed -- each with its run directory.
* ``runner``: trains each run (a ``megafixed train`` subprocess, so every run is a fresh process
  like a user's), skips finished ones, resumes interrupted ones, evaluates each.
* ``report``: ``report.md`` with tables over seeds, paired differences, and PNG curves.
* ``probe``: linear probes from each layer's hidden state back to the token's code bits.
"""
