"""The three-interface study (``megafixed study``) and the input probe (``megafixed probe``).

* ``plan``: the runs of a study -- grid point x interface x seed -- each with its run directory.
* ``runner``: trains each run in this process (as ``megafixed train`` would), skips finished ones,
  resumes interrupted ones, evaluates each.
* ``heldout``: each run's test-split loss and bits per byte (through ``megafixed.model.heldout``).
* ``report``: ``report.md`` with tables over seeds, paired differences, and PNG curves.
* ``probe``: linear probes from each layer's hidden state back to the token's code bits.
"""
