"""``mtdao slow-link``: DDP against MT-DAO with real gloo workers across an emulated slow link."""
