"""The registered studies, name -> Study in MODULES' order (the command line lists them so): filled by
`openrlhf_geo.lab.studies.register`, read by the command and the runner, which import this module and not the
package, so that no study module imports its importer."""

REGISTRY = {}
