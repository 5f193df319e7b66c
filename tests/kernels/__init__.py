# Package marker: tests/worker/ has a test_paged_attention.py too (pytest needs distinct names).
