"""The generic lowering: range analysis over rectangles of tiles, the pairs it samples, the
combination of parts lowered apart, and the dispatch that tries the registered rules first."""
