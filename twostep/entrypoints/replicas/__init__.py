"""Engine replicas on Ray Serve behind one OpenAI endpoint (`twostep serve --data-parallel-size N`)."""
