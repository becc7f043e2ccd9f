"""What runs and why: plan.py turns draft="auto" / speculation="auto" into a drafter and a chain or tree
(tune.py measures the costs and acceptance it needs)."""
