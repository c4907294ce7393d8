"""The rank side: planning, references and the steps of one case on one rank."""
