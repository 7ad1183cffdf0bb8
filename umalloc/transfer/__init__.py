"""The transfer layer: peer layouts, row arithmetic, descriptors, transfer plans and their builders."""
