"""``mpitf bench``: run the benchmark suites, fit the cost model, write the report.

Holds the suites ``pushpull``, ``scaling``, ``modes`` and ``kernels`` (each runnable with
``python -m``), ``runner`` (the suites under the launcher), ``costmodel`` (alpha-beta fits
and projections, pure) and ``report`` (markdown and plots). May import anything below it.
"""
