"""What reaches an operator's terminal: the one sanitiser of text from the network or state files."""
