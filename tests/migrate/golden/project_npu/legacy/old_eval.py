print "python 2 syntax: torch.cuda is unparseable here"
