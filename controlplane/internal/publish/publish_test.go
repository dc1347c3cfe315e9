package publish

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// rotateKeyRow writes a key.rotated row for id with grace (0: none),
// as RotateKey does (the key's hashes are not what this checks).
func rotateKeyRow(t *testing.T, st *store.Store, orgID, id string, grace time.Duration) {
	t.Helper()
	ctx := context.Background()
	var payload events.KeyRotatedPayload
	if grace > 0 {
		payload.GraceUntil = time.Now().Add(grace).UTC().Format(time.RFC3339Nano)
	}
	require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
		if err := tx.Audit(ctx, audit.ActionRotated, "key", id, orgID, "", []byte(`{}`), []byte(`{}`)); err != nil {
			return err
		}
		ev, err := events.New(events.KeyRotated, orgID, id, payload)
		if err != nil {
			return err
		}
		return tx.Outbox(ctx, ev)
	}))
}

// kinds lists the events' kinds and seqs.
func kinds(evs []*configv1.RegionEvent) []string {
	out := make([]string, len(evs))
	for i, re := range evs {
		out[i] = re.GetEvent().GetKind()
	}
	return out
}

// TestEventsPerRegion: every change reaches the auto region's stream in
// outbox order, numbered 1, 2, 3... by region_seq with increasing event
// seqs, each carrying its state; a staged region's stream gets only the
// security events (blocks, deletions, rotations without grace), in the
// same order, numbered by its own sequence.
func TestEventsPerRegion(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	a := r.start(testsvc.NewDatabase(t))
	mkRegion(t, a.st, "canary", store.RolloutStaged)
	org, k := mkKey(t, a.st, "")
	setKey(t, a.st, k, "blocked")
	setKey(t, a.st, k, "unblocked")
	rotateKeyRow(t, a.st, org, k, time.Hour)
	rotateKeyRow(t, a.st, org, k, 0)
	_, k2 := mkKey(t, a.st, org)
	setKey(t, a.st, k2, "deleted")
	r.settled(a, "default")

	def := r.stream("default")
	require.Equal(t, []string{"org.upserted", "key.upserted", "key.blocked", "key.unblocked", "key.rotated", "key.rotated",
		"key.upserted", "key.deleted"}, kinds(def))
	for i, re := range def {
		require.Equal(t, "default", re.GetRegion())
		require.Equal(t, uint64(i+1), re.GetRegionSeq())
		if i > 0 {
			require.Greater(t, re.GetEvent().GetSeq(), def[i-1].GetEvent().GetSeq(), "event seqs follow the outbox")
		}
	}
	require.Equal(t, org, def[0].GetEvent().GetOrg().GetId())
	require.False(t, def[0].GetEvent().GetSecurity())
	require.Equal(t, k, def[1].GetEvent().GetKey().GetId())
	require.Equal(t, &configv1.BlockChange{ObjectType: "key", Id: k, Blocked: true}, def[2].GetEvent().GetBlock())
	require.True(t, def[2].GetEvent().GetSecurity())
	require.Equal(t, &configv1.BlockChange{ObjectType: "key", Id: k, Blocked: false}, def[3].GetEvent().GetBlock())
	require.False(t, def[3].GetEvent().GetSecurity())
	require.False(t, def[4].GetEvent().GetSecurity(), "a rotation with grace is not a security event")
	require.True(t, def[5].GetEvent().GetSecurity(), "a rotation without grace is")
	require.Equal(t, k2, def[7].GetEvent().GetKeyDeleted())
	require.True(t, def[7].GetEvent().GetSecurity())

	canary := r.stream("canary")
	require.Equal(t, []string{"key.blocked", "key.rotated", "key.deleted"}, kinds(canary))
	for i, re := range canary {
		require.Equal(t, uint64(i+1), re.GetRegionSeq(), "the staged region's own sequence")
		require.True(t, re.GetEvent().GetSecurity())
	}
	require.Equal(t, def[2].GetEvent().GetSeq(), canary[0].GetEvent().GetSeq(), "the same event, same outbox seq")
	require.Equal(t, def[5].GetEvent().GetSeq(), canary[1].GetEvent().GetSeq())
	require.Equal(t, def[7].GetEvent().GetSeq(), canary[2].GetEvent().GetSeq())
	require.Equal(t, int64(len(def)+len(canary)), a.p.Stats().EventsPublished)
}

// requireStreamPosition checks that ptr names region's stream position at
// compile time: never past the stream's end, no event at or before it
// missing from the snapshot (a data plane never replays those), and every
// event after it either covered by the snapshot (a compile that raced the
// event's append: the data plane skips it as already applied) or not yet
// compiled. The compile reads the region positions before the state, so
// the position may lag the state by events published meanwhile, never
// lead it.
func (r *epochRig) requireStreamPosition(ptr *configv1.SnapshotPointer, region string) {
	r.t.Helper()
	events := r.stream(region)
	require.LessOrEqual(r.t, ptr.GetRegionSeq(), lastStreamSeq(r.t, r.js, region), "the position is inside the stream")
	for _, re := range events {
		if re.GetRegionSeq() <= ptr.GetRegionSeq() {
			require.LessOrEqual(r.t, re.GetEvent().GetSeq(), ptr.GetEventsSeq(), "event %d before the position is in the snapshot", re.GetRegionSeq())
		}
	}
}

// TestSnapshotVersions: each compile after changes records a higher
// version whose snapshot holds the state up to the outbox head, and the
// region's pointer names it with the region's stream position at compile
// time.
func TestSnapshotVersions(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	a := r.start(testsvc.NewDatabase(t))
	org, k := mkKey(t, a.st, "")
	p1 := r.settled(a, "default")
	s1 := r.snapshot(p1)
	require.Equal(t, p1.GetVersion(), s1.GetVersion())
	require.Equal(t, p1.GetEventsSeq(), s1.GetEventsSeq())
	r.requireStreamPosition(p1, "default")
	require.NotNil(t, snapKey(s1, k))
	require.False(t, snapKey(s1, k).GetBlocked())

	setKey(t, a.st, k, "blocked")
	_, k2 := mkKey(t, a.st, org)
	p2 := r.settled(a, "default")
	s2 := r.snapshot(p2)
	require.Greater(t, p2.GetVersion(), p1.GetVersion(), "versions only grow")
	require.Greater(t, p2.GetEventsSeq(), p1.GetEventsSeq())
	r.requireStreamPosition(p2, "default")
	require.True(t, snapKey(s2, k).GetBlocked())
	require.NotNil(t, snapKey(s2, k2))
	// Stats are updated after the pointer is written: wait for them to
	// name the version the pointer does.
	var st Stats
	require.Eventually(t, func() bool { st = a.p.Stats(); return st.LastVersion >= int64(p2.GetVersion()) }, 10*time.Second, 5*time.Millisecond)
	require.True(t, st.Leader)
	require.GreaterOrEqual(t, st.Compiles, int64(2))
	require.Equal(t, int64(p2.GetVersion()), st.LastVersion)
	require.Positive(t, st.LastSnapshotBytes)
	require.Zero(t, st.CompileErrors)
}

// TestUnknownKindStopsPublishing: an outbox row of a kind the registry
// does not hold is neither published nor skipped: publishAll fails on it
// (ErrUnknownKind), and it stays pending with the rows after it; what an
// earlier round published stays published.
func TestUnknownKindStopsPublishing(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testsvc.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool, nil)
	// Not running: this test drives one publishing round itself.
	p, err := New(Config{InstanceID: "test", Logger: testLogger()}, st, pool, r.nc)
	require.NoError(t, err)
	require.NoError(t, p.ensureInfra(ctx))
	org, _ := mkKey(t, st, "")
	changed, _, err := p.publishAll(ctx)
	require.NoError(t, err)
	require.True(t, changed)
	require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
		if err := tx.Audit(ctx, "test", "org", org, org, "", nil, []byte(`{}`)); err != nil {
			return err
		}
		return tx.Outbox(ctx, store.OutboxEvent{Kind: "org.renamed", OrgID: org, ObjectType: "org", ObjectID: org})
	}))
	_, _ = mkKey(t, st, org)

	_, _, err = p.publishAll(ctx)
	require.ErrorIs(t, err, events.ErrUnknownKind)
	var pending int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&pending))
	require.Equal(t, 2, pending, "the unknown row and the one after it wait")
	require.Equal(t, []string{"org.upserted", "key.upserted"}, kinds(r.stream("default")), "the rows before it are published")
}

// TestKeyRotatedPayloadShape pins the payload a rotation stores (the
// admin handler writes it, Security reads it).
func TestKeyRotatedPayloadShape(t *testing.T) {
	b, err := json.Marshal(events.KeyRotatedPayload{})
	require.NoError(t, err)
	require.JSONEq(t, `{}`, string(b))
	b, err = json.Marshal(events.KeyRotatedPayload{GraceUntil: "2026-01-01T00:00:00Z"})
	require.NoError(t, err)
	require.JSONEq(t, `{"grace_until":"2026-01-01T00:00:00Z"}`, string(b))
}
