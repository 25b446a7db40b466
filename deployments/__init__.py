"""Ray Serve deployments of fluxserve: the FastAPI ingress and the FluxReplica pools."""
