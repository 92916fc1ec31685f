"""Compute once, fan out: branches from one prefilled document, and DAG pipelines of them."""
