"""What people read: the tables and trees the commands print (JSON output never comes through here)."""
