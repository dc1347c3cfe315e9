// Package store is the control plane's access to Postgres. It is the only
// importer of the sqlc package (dbsqlc): it returns its own small types and
// interprets database errors in one place.
//
// Every mutation runs through Store.Mutate: one transaction that first
// locks the chain head (so audit and outbox sequence numbers follow commit
// order), applies the change, appends exactly one audit record and any
// outbox rows, and commits them together.
package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Sentinel errors; every error the store returns for a client mistake is
// an *Error wrapping one of them.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
)

// Error is a store error whose message is safe to show to API clients.
type Error struct {
	Code error
	Msg  string
}

func (e *Error) Error() string { return e.Msg }
func (e *Error) Unwrap() error { return e.Code }

func notFound(what string) error {
	return &Error{Code: ErrNotFound, Msg: what + " not found"}
}

// constraintMessages explains constraint violations to clients.
var constraintMessages = map[string]string{
	"orgs_name_key":                       "an org with this name already exists",
	"teams_org_id_name_key":               "a team with this name already exists in the org",
	"users_org_id_email_key":              "a user with this email already exists in the org",
	"customers_org_id_external_id_key":    "a customer with this external_id already exists in the org",
	"team_members_pkey":                   "the user is already a member of the team",
	"keys_org_id_team_id_fkey":            "team_id does not name a team of the key's org",
	"keys_org_id_user_id_fkey":            "user_id does not name a user of the key's org",
	"team_members_org_id_user_id_fkey":    "user_id does not name a user of the team's org",
	"admin_tokens_org_id_team_id_fkey":    "team_id does not name a team of the token's org",
	"admin_tokens_org_id_fkey":            "org_id does not name an org",
	"teams_org_id_fkey":                   "org_id does not name an org",
	"users_org_id_fkey":                   "org_id does not name an org",
	"customers_org_id_fkey":               "org_id does not name an org",
	"keys_org_id_fkey":                    "org_id does not name an org",
	"model_groups_pkey":                   "a model group with this name already exists",
	"deployments_model_group_fkey":        "model_group does not name a model group",
	"model_group_grants_model_group_fkey": "model_group does not name a model group",
	"model_group_grants_org_id_fkey":      "org_id does not name an org",
	"alert_webhooks_org_id_fkey":          "org_id does not name an org",
}

// translate maps database errors to store errors. Messages of unknown
// database errors are not passed on to clients.
func translate(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return notFound("object")
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		msg := constraintMessages[pe.ConstraintName]
		switch pe.Code {
		case "23505": // unique_violation
			if msg == "" {
				msg = "an object with these values already exists"
			}
			return &Error{Code: ErrAlreadyExists, Msg: msg}
		case "23503": // foreign_key_violation
			if msg == "" {
				msg = "the object is still referenced by other objects"
			}
			if pe.Message != "" && isDeleteViolation(pe) {
				msg = "the object is still referenced by other objects; delete those first"
			}
			return &Error{Code: ErrFailedPrecondition, Msg: msg}
		case "23514": // check_violation
			return &Error{Code: ErrFailedPrecondition, Msg: "a value is outside its allowed range (" + pe.ConstraintName + ")"}
		}
	}
	return err
}

// IsUnavailable reports whether err means Postgres could not be reached
// or dropped the connection, rather than refusing the statement: a failed
// connect (refused, timed out, database gone), a connection closed or
// reset under the statement, an unexpected EOF from the server, SQLSTATE
// class 08 (connection exception), 57P01-57P03 (administrator, crash or
// startup shutdown) and 53300 (too many connections). Such a failure is
// retryable; the admin API answers it as Unavailable.
//
// A context that ended is not unavailability: callers check their own
// context first (pgconn reports a done context as safe to retry).
func IsUnavailable(err error) bool {
	if err == nil {
		return false
	}
	var ce *pgconn.ConnectError
	var ope *net.OpError
	switch {
	case errors.As(err, &ce), errors.As(err, &ope),
		errors.Is(err, pgconn.ErrConnClosed), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.Is(err, syscall.ECONNREFUSED):
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"), pe.Code == "57P01", pe.Code == "57P02", pe.Code == "57P03", pe.Code == "53300":
			return true
		}
		return false
	}
	// pgconn marks failures that happened before anything was sent (a
	// closed or broken connection); an EOF only counts when it comes
	// through pgconn, which wraps socket errors this way.
	var retry interface{ SafeToRetry() bool }
	if errors.As(err, &retry) {
		return retry.SafeToRetry() || errors.Is(err, io.EOF)
	}
	return false
}

func isDeleteViolation(pe *pgconn.PgError) bool {
	// "update or delete on table ... violates foreign key constraint"
	return len(pe.Message) > 16 && pe.Message[:16] == "update or delete"
}

// Store reads and writes the control plane's state.
type Store struct {
	pool *pgxpool.Pool
	q    *dbsqlc.Queries
	now  func() time.Time
}

// New returns a store over pool. now is the clock (time.Now in
// production; tests pass their own).
func New(pool *pgxpool.Pool, now func() time.Time) *Store {
	if now == nil {
		now = time.Now
	}
	return &Store{pool: pool, q: dbsqlc.New(), now: now}
}

// Now returns the store's clock reading, truncated to Postgres precision.
func (s *Store) Now() time.Time { return s.now().UTC().Truncate(time.Microsecond) }

// Actor identifies who makes a change, for the audit record.
type Actor struct {
	ID        string // principal id: "bootstrap" or an admin token id
	TokenID   string
	RequestID string
}

// OutboxEvent is a change the data planes must learn (published by the
// config distribution; see outbox table). Rows are built by package
// events, which owns the kinds and their payloads.
type OutboxEvent struct {
	Kind       string
	OrgID      string
	ObjectType string
	ObjectID   string
	Payload    []byte // JSON object; nil means {}
}

// Tx is a mutation in progress. It is only valid inside Mutate's function.
type Tx struct {
	tx        pgx.Tx
	q         *dbsqlc.Queries
	actor     Actor
	now       time.Time
	auditSeq  int64
	auditHash []byte
	outboxSeq int64
	audits    int
}

// Now is the time of the mutation (one reading for the whole transaction).
func (t *Tx) Now() time.Time { return t.now }

// Audit appends the mutation's audit record. before and after are JSON
// documents (nil for none), stored in canonical form; they must never
// contain secrets.
func (t *Tx) Audit(ctx context.Context, action, objectType, objectID, orgID, teamID string, before, after []byte) error {
	b, err := audit.CanonicalJSON(before)
	if err != nil {
		return err
	}
	a, err := audit.CanonicalJSON(after)
	if err != nil {
		return err
	}
	r := &audit.Record{
		At: t.now, Actor: t.actor.ID, TokenID: t.actor.TokenID, Action: action,
		ObjectType: objectType, ObjectID: objectID, OrgID: orgID, TeamID: teamID,
		RequestID: t.actor.RequestID, BeforeJSON: b, AfterJSON: a,
	}
	audit.Seal(r, t.auditSeq, t.auditHash)
	err = t.q.AuditInsert(ctx, t.tx, dbsqlc.AuditInsertParams{
		Seq: r.Seq, At: r.At, Actor: r.Actor, TokenID: r.TokenID, Action: r.Action,
		ObjectType: r.ObjectType, ObjectID: r.ObjectID, OrgID: r.OrgID, TeamID: r.TeamID,
		RequestID: r.RequestID, BeforeJson: r.BeforeJSON, AfterJson: r.AfterJSON,
		PrevHash: r.PrevHash, Hash: r.Hash,
	})
	if err != nil {
		return fmt.Errorf("insert audit record: %w", err)
	}
	t.auditSeq, t.auditHash = r.Seq, r.Hash
	t.audits++
	return nil
}

// Outbox appends events for the data planes, in order.
func (t *Tx) Outbox(ctx context.Context, events ...OutboxEvent) error {
	for _, ev := range events {
		payload := ev.Payload
		if payload == nil {
			payload = []byte("{}")
		}
		t.outboxSeq++
		err := t.q.OutboxInsert(ctx, t.tx, dbsqlc.OutboxInsertParams{
			Seq: t.outboxSeq, At: t.now, Kind: ev.Kind, OrgID: ev.OrgID,
			ObjectType: ev.ObjectType, ObjectID: ev.ObjectID, Payload: payload,
		})
		if err != nil {
			return fmt.Errorf("insert outbox row: %w", err)
		}
	}
	return nil
}

// ErrNoAudit is returned when a mutation did not write exactly one audit
// record; the transaction is rolled back.
var ErrNoAudit = errors.New("mutation must write exactly one audit record")

// Mutate runs fn in a transaction that holds the chain head lock, and
// commits only if fn succeeded and wrote exactly one audit record.
func (s *Store) Mutate(ctx context.Context, actor Actor, fn func(tx *Tx) error) error {
	err := pgx.BeginFunc(ctx, s.pool, func(ptx pgx.Tx) error {
		head, err := s.q.ChainHeadLock(ctx, ptx)
		if err != nil {
			return fmt.Errorf("lock chain head: %w", err)
		}
		t := &Tx{
			tx: ptx, q: s.q, actor: actor, now: s.Now(),
			auditSeq: head.AuditSeq, auditHash: head.AuditHash, outboxSeq: head.OutboxSeq,
		}
		if err := fn(t); err != nil {
			return err
		}
		if t.audits != 1 {
			return fmt.Errorf("%w (wrote %d)", ErrNoAudit, t.audits)
		}
		return s.q.ChainHeadSet(ctx, ptx, dbsqlc.ChainHeadSetParams{
			AuditSeq: t.auditSeq, AuditHash: t.auditHash, OutboxSeq: t.outboxSeq,
		})
	})
	return translate(err)
}

// optStr returns nil for "" and &s otherwise (for sqlc.narg filters).
func optStr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// derefStr returns "" for nil.
func derefStr(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Page is a keyset page request: rows after After, at most Limit.
type Page struct {
	After string
	Limit int
}

func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

var pgxRepeatableReadRO = pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}
