"""The store: the database (SQLite or PostgreSQL), its tables and migrations, the audit trail, finality records, backups and the state lock."""
