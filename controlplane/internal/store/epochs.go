package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Distribution epochs (docs/distribution.md "Backup and restore"). When
// the leader finds JetStream ahead of this database (restored from a
// backup, or replaced, while NATS kept its data) it starts an epoch: the
// next snapshot version is above every version JetStream held, the next
// outbox sequence above every event sequence it held, and each region's
// stream continues after its last message, so the data planes accept the
// new snapshot as newer and replay nothing twice.

// EpochActor is the audit actor of what the publisher does by itself.
const EpochActor = "system:distribution"

// ObjectTypeDistribution is the audit object type of epochs.
const ObjectTypeDistribution = "distribution"

// Epoch is a distribution epoch.
type Epoch struct {
	Epoch     int64
	StartedAt time.Time
	// VersionFloor: versions of this epoch are above it.
	VersionFloor int64
	// EventsFloor: outbox sequences of this epoch are above it.
	EventsFloor int64
	// FirstVersion is the epoch's first compiled version (0 until then);
	// it becomes current in every region.
	FirstVersion int64
	Reason       string
	Detail       EpochDetail
}

// EpochDetail is what JetStream and the database held when an epoch
// started (distribution_epochs.detail).
type EpochDetail struct {
	// DatabaseVersion and DatabaseEventsSeq are the database's highest
	// version and outbox sequence before the epoch.
	DatabaseVersion   int64 `json:"database_version"`
	DatabaseEventsSeq int64 `json:"database_events_seq"`
	// JetStreamVersion is the highest snapshot version JetStream held
	// (pointers and objects), JetStreamEventsSeq its highest event
	// sequence (pointers and the last message of every region stream).
	JetStreamVersion   int64 `json:"jetstream_version"`
	JetStreamEventsSeq int64 `json:"jetstream_events_seq"`
	// Regions: per region of this database, its stream position in the
	// database and in JetStream.
	Regions map[string]EpochRegion `json:"regions,omitempty"`
	// Reapplied lists the revocations of the abandoned history the epoch
	// re-applied ("key k_123 blocked", ...).
	Reapplied []string `json:"reapplied,omitempty"`
	// Unapplied lists security events of the abandoned history that were
	// not re-applied, and why.
	Unapplied []string `json:"unapplied,omitempty"`
}

// EpochRegion is one region's stream position when an epoch started.
type EpochRegion struct {
	DatabaseSeq int64 `json:"database_seq"`
	StreamSeq   int64 `json:"stream_seq"`
}

func epochFromRow(r dbsqlc.DistributionEpoch) (Epoch, error) {
	e := Epoch{Epoch: r.Epoch, StartedAt: r.StartedAt, VersionFloor: r.VersionFloor, EventsFloor: r.EventsFloor, Reason: r.Reason}
	if r.FirstVersion != nil {
		e.FirstVersion = *r.FirstVersion
	}
	if len(r.Detail) > 0 {
		if err := json.Unmarshal(r.Detail, &e.Detail); err != nil {
			return Epoch{}, fmt.Errorf("decode detail of epoch %d: %w", r.Epoch, err)
		}
	}
	return e, nil
}

// CurrentEpoch returns the latest epoch; ok is false in epoch 0 (none
// started).
func (s *Store) CurrentEpoch(ctx context.Context) (Epoch, bool, error) {
	return currentEpoch(ctx, s.q, s.pool)
}

// CurrentEpoch is Store.CurrentEpoch inside the transaction.
func (t *Tx) CurrentEpoch(ctx context.Context) (Epoch, bool, error) {
	return currentEpoch(ctx, t.q, t.tx)
}

func currentEpoch(ctx context.Context, q *dbsqlc.Queries, db dbsqlc.DBTX) (Epoch, bool, error) {
	r, err := q.EpochLatest(ctx, db)
	if isNoRows(err) {
		return Epoch{}, false, nil
	}
	if err != nil {
		return Epoch{}, false, fmt.Errorf("read distribution epoch: %w", err)
	}
	e, err := epochFromRow(r)
	return e, err == nil, err
}

// EpochStart is what the publisher found when it decided to start an
// epoch.
type EpochStart struct {
	// VersionFloor and EventsFloor are the highest snapshot version and
	// event sequence JetStream holds; the epoch numbers above them (and
	// above the database's own).
	VersionFloor int64
	EventsFloor  int64
	// StreamSeqs is, per region of the database, the last sequence of its
	// event stream: the region's events continue after it.
	StreamSeqs map[string]int64
	Reason     string
	Detail     EpochDetail
}

// StartEpoch records a new epoch in one transaction under the chain head
// lock (no admin change commits in between): the outbox sequence moves up
// to the events floor, every region's position to its stream's last
// sequence, and outbox rows not yet published are marked published (the
// epoch's first snapshot, compiled next, carries their state). It is
// audited as "epoch_started" on object type "distribution".
func (s *Store) StartEpoch(ctx context.Context, in EpochStart) (Epoch, error) {
	var out Epoch
	err := s.Mutate(ctx, Actor{ID: EpochActor}, func(t *Tx) error {
		var prev int64
		if cur, ok, err := t.CurrentEpoch(ctx); err != nil {
			return err
		} else if ok {
			prev = cur.Epoch
		}
		dbFloor, err := t.q.ConfigVersionFloor(ctx, t.tx)
		if err != nil {
			return fmt.Errorf("read config versions: %w", err)
		}
		in.Detail.DatabaseVersion, in.Detail.DatabaseEventsSeq = dbFloor, t.outboxSeq
		t.outboxSeq = max(t.outboxSeq, in.EventsFloor)
		out = Epoch{Epoch: prev + 1, StartedAt: t.now, VersionFloor: max(dbFloor, in.VersionFloor),
			EventsFloor: t.outboxSeq, Reason: in.Reason, Detail: in.Detail}
		detail, err := json.Marshal(out.Detail)
		if err != nil {
			return err
		}
		if err := t.q.EpochInsert(ctx, t.tx, dbsqlc.EpochInsertParams{Epoch: out.Epoch, StartedAt: out.StartedAt,
			VersionFloor: out.VersionFloor, EventsFloor: out.EventsFloor, Reason: out.Reason, Detail: detail}); err != nil {
			return fmt.Errorf("insert distribution epoch: %w", err)
		}
		if _, err := t.q.ConfigRegionsLock(ctx, t.tx); err != nil {
			return fmt.Errorf("lock regions: %w", err)
		}
		for _, name := range slices.Sorted(maps.Keys(in.StreamSeqs)) {
			if err := t.q.ConfigRegionSetSeq(ctx, t.tx, dbsqlc.ConfigRegionSetSeqParams{Name: name, RegionSeq: in.StreamSeqs[name]}); err != nil {
				return fmt.Errorf("store region position: %w", err)
			}
		}
		now := t.now
		if _, err := t.q.EpochOutboxDrop(ctx, t.tx, &now); err != nil {
			return fmt.Errorf("mark outbox published: %w", err)
		}
		after, err := json.Marshal(map[string]any{"epoch": out.Epoch, "version_floor": out.VersionFloor,
			"events_floor": out.EventsFloor, "reason": out.Reason, "detail": out.Detail})
		if err != nil {
			return err
		}
		return t.Audit(ctx, audit.ActionEpochStarted, ObjectTypeDistribution, fmt.Sprintf("epoch-%d", out.Epoch), "", "", nil, after)
	})
	return out, err
}

// EpochRecordReapplied stores the revocations epoch re-applied (and the
// security events it could not) in its detail.
func (s *Store) EpochRecordReapplied(ctx context.Context, epoch int64, reapplied, unapplied []string) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		r, err := s.q.EpochLatestForUpdate(ctx, tx)
		if err != nil {
			return fmt.Errorf("read distribution epoch: %w", err)
		}
		if r.Epoch != epoch {
			return fmt.Errorf("epoch %d is no longer the latest (%d)", epoch, r.Epoch)
		}
		e, err := epochFromRow(r)
		if err != nil {
			return err
		}
		e.Detail.Reapplied, e.Detail.Unapplied = reapplied, unapplied
		detail, err := json.Marshal(e.Detail)
		if err != nil {
			return err
		}
		return s.q.EpochSetDetail(ctx, tx, dbsqlc.EpochSetDetailParams{Epoch: epoch, Detail: detail})
	})
}

// OutboxHead is the last outbox sequence assigned.
func (s *Store) OutboxHead(ctx context.Context) (int64, error) {
	h, err := s.q.ChainHeadGet(ctx, s.pool)
	if err != nil {
		return 0, fmt.Errorf("read chain head: %w", err)
	}
	return h.OutboxSeq, nil
}

// ConfigVersionDigest returns the digest of version v; ok is false when
// the database has no such version.
func (s *Store) ConfigVersionDigest(ctx context.Context, v int64) ([]byte, bool, error) {
	d, err := s.q.ConfigVersionDigest(ctx, s.pool, v)
	if isNoRows(err) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read config version %d: %w", v, err)
	}
	return d, true, nil
}

// PendingRow is an outbox row not yet published.
type PendingRow struct {
	Seq        int64
	Kind       string
	ObjectType string
	ObjectID   string
}

// PendingOutbox returns up to limit unpublished outbox rows in order.
func (s *Store) PendingOutbox(ctx context.Context, limit int) ([]PendingRow, error) {
	rows, err := s.q.ConfigPendingOutbox(ctx, s.pool, int32(limit))
	if err != nil {
		return nil, fmt.Errorf("read outbox: %w", err)
	}
	out := make([]PendingRow, len(rows))
	for i, r := range rows {
		out[i] = PendingRow{Seq: r.Seq, Kind: r.Kind, ObjectType: r.ObjectType, ObjectID: r.ObjectID}
	}
	return out, nil
}

// errNothingToReapply ends a ReapplyBlock transaction that changes nothing.
var errNothingToReapply = errors.New("nothing to re-apply")

// ReapplyBlock blocks objectType id (key, user, team, org or customer) as
// the epoch actor: a revocation of the abandoned history that this
// database does not have. It is audited as "blocked" with why in the
// record and goes out as an ordinary block event. It reports false when
// the object does not exist here or is blocked already.
func (s *Store) ReapplyBlock(ctx context.Context, objectType, id, why string) (bool, error) {
	all := Tenant{}
	err := s.Mutate(ctx, Actor{ID: EpochActor}, func(t *Tx) error {
		var orgID, teamID string
		var err error
		switch objectType {
		case "key":
			var k Key
			if k, err = t.KeyGetForUpdate(ctx, all, id); err == nil {
				if k.Blocked {
					return errNothingToReapply
				}
				orgID, teamID, err = k.OrgID, k.TeamID, t.KeySetBlocked(ctx, &k, true)
			}
		case "user":
			var u User
			if u, err = t.UserGetForUpdate(ctx, all, id); err == nil {
				if u.Blocked {
					return errNothingToReapply
				}
				orgID, err = u.OrgID, t.UserSetBlocked(ctx, &u, true)
			}
		case "team":
			var tm Team
			if tm, err = t.TeamGetForUpdate(ctx, all, id); err == nil {
				if tm.Blocked {
					return errNothingToReapply
				}
				orgID, teamID, err = tm.OrgID, tm.ID, t.TeamSetBlocked(ctx, &tm, true)
			}
		case "org":
			var o Org
			if o, err = t.OrgGetForUpdate(ctx, all, id); err == nil {
				if o.Blocked {
					return errNothingToReapply
				}
				orgID, err = o.ID, t.OrgSetBlocked(ctx, &o, true)
			}
		case "customer":
			var c Customer
			if c, err = t.CustomerGetForUpdate(ctx, all, id); err == nil {
				if c.Blocked {
					return errNothingToReapply
				}
				orgID, err = c.OrgID, t.CustomerSetBlocked(ctx, &c, true)
			}
		default:
			return fmt.Errorf("cannot block a %s", objectType)
		}
		if errors.Is(err, ErrNotFound) {
			return errNothingToReapply
		}
		if err != nil {
			return err
		}
		before, _ := json.Marshal(map[string]any{"id": id, "blocked": false})
		after, _ := json.Marshal(map[string]any{"id": id, "blocked": true, "reason": why})
		if err := t.Audit(ctx, audit.ActionBlocked, objectType, id, orgID, teamID, before, after); err != nil {
			return err
		}
		return t.Outbox(ctx, OutboxEvent{Kind: objectType + ".blocked", OrgID: orgID, ObjectType: objectType, ObjectID: id})
	})
	if errors.Is(err, errNothingToReapply) {
		return false, nil
	}
	return err == nil, err
}
