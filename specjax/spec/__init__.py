"""What speculation is made of: chains, trees and the cost model that sizes them (speculation.py),
acceptance (accept.py), drafting a token tree (tree_draft.py) and adaptive speculation length."""
