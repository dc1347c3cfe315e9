// Package auditexport publishes every audit record, in chain order and
// exactly once, to the JetStream stream SLUICE_AUDIT (SPEC §5), from
// where it is shipped to immutable storage.
//
// The export is an outbox over the audit log itself: audit_export holds
// the sequence of the last record the stream acknowledged. One replica
// at a time (a Postgres advisory lock) reads the records after it, in
// sequence order, publishes each synchronously with the record's
// sequence as its JetStream message id, and advances the position. A
// crash between an acknowledgement and the position's update republishes
// the record with the same id, which the stream's duplicate window
// drops; and before publishing, the exporter reads the stream's last
// message and starts after it, so a record is never stored twice even
// past that window. Publishing one record at a time, in order, keeps the
// stream in chain order: no record is stored before its predecessor.
//
// A record is published as soon as its transaction commits: a trigger
// on audit_log notifies sluice_audit, which wakes the exporter; a poll
// (Config.Poll) is the backstop should a notification be missed.
package auditexport

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// Stream and subject names, and the header carrying the sequence.
const (
	StreamName = "SLUICE_AUDIT"
	Subject    = "sluice.audit.records"
	SeqHeader  = "Sluice-Audit-Seq"
)

// Defaults.
const (
	DefaultRetention = 90 * 24 * time.Hour
	DefaultPoll      = time.Second
	// duplicateWindow is the stream's duplicate-detection window.
	duplicateWindow = 10 * time.Minute
	batch           = 500
	// leaderLockID is the advisory lock of the exporter ("sluaudx").
	leaderLockID = 0x736c7561756478
	retryDelay   = time.Second
)

// Config configures the exporter.
type Config struct {
	// Pool is the control plane's pool; the exporter connects with its
	// configuration but through connections of its own (a lock and
	// notification connection and a pool of two), so a burst of admin
	// traffic never starves the export.
	Pool *pgxpool.Pool
	NC   *nats.Conn
	// Retention is the stream's MaxAge (DefaultRetention if 0).
	Retention time.Duration
	// Poll bounds how long a record waits if a notification is missed
	// (DefaultPoll if 0).
	Poll   time.Duration
	Logger *slog.Logger
	// Stream overrides StreamName and Subject (tests isolate by these).
	Stream, Subject string
}

// Exporter publishes audit records to JetStream.
type Exporter struct {
	cfg Config
	js  jetstream.JetStream
	log *slog.Logger
}

// New returns an exporter; Run does the work.
func New(cfg Config) (*Exporter, error) {
	if cfg.Pool == nil || cfg.NC == nil {
		return nil, errors.New("auditexport: Pool and NC are required")
	}
	if cfg.Retention < 0 {
		return nil, errors.New("auditexport: Retention must not be negative")
	}
	if cfg.Retention == 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.Poll <= 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.Stream == "" {
		cfg.Stream = StreamName
	}
	if cfg.Subject == "" {
		cfg.Subject = Subject
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(cfg.NC)
	if err != nil {
		return nil, fmt.Errorf("auditexport: jetstream: %w", err)
	}
	return &Exporter{cfg: cfg, js: js, log: cfg.Logger}, nil
}

// Message is the JSON body of one exported record: every field the hash
// covers, so a consumer recomputes the chain from the stream alone
// (audit.ComputeHash over the same fields).
type Message struct {
	Seq        int64     `json:"seq"`
	At         time.Time `json:"at"`
	Actor      string    `json:"actor"`
	TokenID    string    `json:"token_id"`
	Action     string    `json:"action"`
	ObjectType string    `json:"object_type"`
	ObjectID   string    `json:"object_id"`
	OrgID      string    `json:"org_id"`
	TeamID     string    `json:"team_id"`
	RequestID  string    `json:"request_id"`
	BeforeJSON string    `json:"before_json"`
	AfterJSON  string    `json:"after_json"`
	PrevHash   []byte    `json:"prev_hash"`
	Hash       []byte    `json:"hash"`
}

// Record is the audit record of m.
func (m Message) Record() audit.Record {
	return audit.Record{Seq: m.Seq, At: m.At, Actor: m.Actor, TokenID: m.TokenID, Action: m.Action, ObjectType: m.ObjectType,
		ObjectID: m.ObjectID, OrgID: m.OrgID, TeamID: m.TeamID, RequestID: m.RequestID, BeforeJSON: m.BeforeJSON,
		AfterJSON: m.AfterJSON, PrevHash: m.PrevHash, Hash: m.Hash}
}

func messageOf(r audit.Record) Message {
	return Message{Seq: r.Seq, At: r.At, Actor: r.Actor, TokenID: r.TokenID, Action: r.Action, ObjectType: r.ObjectType,
		ObjectID: r.ObjectID, OrgID: r.OrgID, TeamID: r.TeamID, RequestID: r.RequestID, BeforeJSON: r.BeforeJSON,
		AfterJSON: r.AfterJSON, PrevHash: r.PrevHash, Hash: r.Hash}
}

// Run exports until ctx ends; it retries (as leader or waiting for the
// lock) on errors, and returns nil once ctx ends (a component of the control plane).
func (e *Exporter) Run(ctx context.Context) error {
	for {
		err := e.lead(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			e.log.WarnContext(ctx, "audit export interrupted", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(retryDelay):
		}
	}
}

// lead takes the exporter lock and exports until an error or ctx ends;
// it returns nil at once when another replica holds the lock.
func (e *Exporter) lead(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, e.cfg.Pool.Config().ConnConfig.Copy())
	if err != nil {
		return fmt.Errorf("connect for export lock: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var got bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, int64(leaderLockID)).Scan(&got); err != nil {
		return fmt.Errorf("export lock: %w", err)
	}
	if !got {
		return nil
	}
	if _, err := conn.Exec(ctx, `LISTEN sluice_audit`); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	if err := e.ensureStream(ctx); err != nil {
		return err
	}
	pcfg := e.cfg.Pool.Config().Copy()
	pcfg.MaxConns, pcfg.MinConns = 2, 0
	epool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("export pool: %w", err)
	}
	defer epool.Close()
	st := store.New(epool, time.Now)
	lctx, cancel := context.WithCancel(ctx)
	wake := make(chan struct{}, 1)
	lost := make(chan error, 1)
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() {
		defer close(done)
		for {
			if _, err := conn.WaitForNotification(lctx); err != nil {
				lost <- err
				return
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	t := time.NewTicker(e.cfg.Poll)
	defer t.Stop()
	for {
		if err := e.drain(ctx, st); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-lost:
			return fmt.Errorf("audit notifications: %w", err)
		case <-wake:
		case <-t.C:
		}
	}
}

func (e *Exporter) ensureStream(ctx context.Context) error {
	maxAge := e.cfg.Retention
	_, err := e.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: e.cfg.Stream, Subjects: []string{e.cfg.Subject}, Storage: jetstream.FileStorage,
		Retention: jetstream.LimitsPolicy, MaxAge: maxAge, Duplicates: duplicateWindow,
		Discard: jetstream.DiscardOld, Description: "Sluice audit records in chain order",
	})
	if err != nil {
		return fmt.Errorf("create stream %s: %w", e.cfg.Stream, err)
	}
	return nil
}

// streamLastSeq is the audit sequence of the stream's last message (0
// if the stream is empty).
func (e *Exporter) streamLastSeq(ctx context.Context) (int64, error) {
	s, err := e.js.Stream(ctx, e.cfg.Stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", e.cfg.Stream, err)
	}
	m, err := s.GetLastMsgForSubject(ctx, e.cfg.Subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("last message of %s: %w", e.cfg.Stream, err)
	}
	n, err := strconv.ParseInt(m.Header.Get(SeqHeader), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("last message of %s has no %s header", e.cfg.Stream, SeqHeader)
	}
	return n, nil
}

// drain publishes every record after the position.
func (e *Exporter) drain(ctx context.Context, st *store.Store) error {
	pos, err := st.AuditExportPosition(ctx)
	if err != nil {
		return err
	}
	last, err := e.streamLastSeq(ctx)
	if err != nil {
		return err
	}
	if last > pos {
		// Published, not yet marked (a crash in between): mark it.
		if err := st.AuditExportAdvance(ctx, last); err != nil {
			return err
		}
		pos = last
	}
	for {
		recs, err := st.AuditList(ctx, store.AuditQuery{AfterSeq: pos}, batch)
		if err != nil {
			return err
		}
		for _, r := range recs {
			if r.Seq != pos+1 {
				return fmt.Errorf("audit record %d follows %d: the chain has a gap", r.Seq, pos)
			}
			body, err := json.Marshal(messageOf(r))
			if err != nil {
				return fmt.Errorf("encode audit record %d: %w", r.Seq, err)
			}
			seq := strconv.FormatInt(r.Seq, 10)
			msg := &nats.Msg{Subject: e.cfg.Subject, Data: body, Header: nats.Header{}}
			msg.Header.Set(SeqHeader, seq)
			if _, err := e.js.PublishMsg(ctx, msg, jetstream.WithMsgID(seq)); err != nil {
				return fmt.Errorf("publish audit record %d: %w", r.Seq, err)
			}
			pos = r.Seq
			if err := st.AuditExportAdvance(ctx, pos); err != nil {
				return err
			}
		}
		if len(recs) < batch {
			return nil
		}
	}
}
