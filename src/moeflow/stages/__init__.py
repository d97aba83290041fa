"""The typed settings of the stages whose scripts load a model, and the opening those scripts share."""
