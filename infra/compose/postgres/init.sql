-- The source table the pipeline follows (Debezium reads it through logical replication).
CREATE TABLE IF NOT EXISTS docs (
    id         bigserial PRIMARY KEY,
    title      text NOT NULL,
    body       text NOT NULL,
    acl        text[] NOT NULL DEFAULT '{}',   -- groups that may read it; empty = public
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- Deletes carry the whole old row (Debezium's "before").
ALTER TABLE docs REPLICA IDENTITY FULL;
INSERT INTO docs (title, body, acl) VALUES
    ('Welcome', 'streamrag follows this table: insert, update or delete a row and ask the API about it.', '{}'),
    ('Payroll calendar', 'Salaries are reviewed every March by the HR team.', '{hr}');
