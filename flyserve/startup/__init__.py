"""The checks every flyserve process makes before it starts anything."""
