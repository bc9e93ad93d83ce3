"""Decoding programs over `models`: AR decoding (`ar`), candidate trees and their acceptance
(`tree`), the drafting methods and their registry (`drafting`), and the speculative cycle in one
`lax.while_loop` (`speculative`). Imports only `models`."""
