-- The demo people directory: teams, the people in them, open positions and leave.
-- Every row carries org_id and every query narrows by it (I5).
CREATE TABLE teams (
    org_id text NOT NULL,
    team_id text NOT NULL,
    name text NOT NULL,
    manager_user_id text NOT NULL,
    PRIMARY KEY (org_id, team_id)
);

CREATE TABLE people (
    org_id text NOT NULL,
    user_id text NOT NULL,
    display_name text NOT NULL,
    team_id text NOT NULL,
    PRIMARY KEY (org_id, user_id),
    FOREIGN KEY (org_id, team_id) REFERENCES teams (org_id, team_id)
);

CREATE TABLE open_positions (
    org_id text NOT NULL,
    position_id text NOT NULL,
    team_id text NOT NULL,
    title text NOT NULL,
    PRIMARY KEY (org_id, position_id),
    FOREIGN KEY (org_id, team_id) REFERENCES teams (org_id, team_id)
);

CREATE TABLE leave_balances (
    org_id text NOT NULL,
    user_id text NOT NULL,
    days_left numeric(5, 1) NOT NULL CHECK (days_left >= 0),
    PRIMARY KEY (org_id, user_id),
    FOREIGN KEY (org_id, user_id) REFERENCES people (org_id, user_id)
);

-- One row per approved request; the idempotency key (cairn's confirmation token)
-- makes a repeat of the same approval a no-op. `deliveries` counts how often it was handed over.
CREATE TABLE leave_requests (
    org_id text NOT NULL,
    request_id text NOT NULL,
    user_id text NOT NULL,
    start_date date NOT NULL,
    days int NOT NULL CHECK (days > 0),
    note text NOT NULL DEFAULT '',
    idempotency_key text NOT NULL,
    run_id text NOT NULL DEFAULT '',
    deliveries int NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, request_id),
    UNIQUE (org_id, idempotency_key),
    FOREIGN KEY (org_id, user_id) REFERENCES people (org_id, user_id)
);

-- The demo org of demo/handbook.yaml: Maria manages engineering, Tom works in it.
INSERT INTO teams VALUES
    ('northwind', 'engineering', 'Engineering', 'maria'),
    ('northwind', 'sales', 'Sales', 'lena');
INSERT INTO people VALUES
    ('northwind', 'maria', 'Maria', 'engineering'),
    ('northwind', 'tom', 'Tom', 'engineering'),
    ('northwind', 'aisha', 'Aisha', 'engineering'),
    ('northwind', 'lena', 'Lena', 'sales'),
    ('northwind', 'jonas', 'Jonas', 'sales');
INSERT INTO open_positions VALUES
    ('northwind', 'pos-eng-1', 'engineering', 'Backend engineer'),
    ('northwind', 'pos-eng-2', 'engineering', 'Site reliability engineer'),
    ('northwind', 'pos-sales-1', 'sales', 'Account executive');
INSERT INTO leave_balances VALUES
    ('northwind', 'maria', 21.0),
    ('northwind', 'tom', 17.5),
    ('northwind', 'aisha', 25.0),
    ('northwind', 'lena', 12.0),
    ('northwind', 'jonas', 28.0);
