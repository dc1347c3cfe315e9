package publish

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// epochRig is one NATS server (its JetStream state outlives the control
// planes) and publishers started on databases one after the other.
type epochRig struct {
	t  *testing.T
	nc *nats.Conn
	js jetstream.JetStream
}

func newEpochRig(t *testing.T) *epochRig {
	n := testsvc.StartNATS(t)
	nc, err := nats.Connect(n.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return &epochRig{t: t, nc: nc, js: js}
}

// running is a publisher leading on one database.
type running struct {
	p    *Publisher
	st   *store.Store
	pool *pgxpool.Pool
	stop func()
}

func testLogger() *slog.Logger {
	if os.Getenv("SLUICE_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// start runs a publisher on the database at url until stop.
func (r *epochRig) start(url string) *running {
	r.t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(r.t, err)
	st := store.New(pool, nil)
	p, err := New(Config{InstanceID: "test", Debounce: 20 * time.Millisecond, MaxDelay: 200 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, TickInterval: time.Hour, Logger: testLogger()}, st, pool, r.nc)
	require.NoError(r.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	once := false
	stop := func() {
		if !once {
			once = true
			cancel()
			<-done
			pool.Close()
		}
	}
	r.t.Cleanup(stop)
	return &running{p: p, st: st, pool: pool, stop: stop}
}

// pointer reads region's KV pointer (nil if absent).
func (r *epochRig) pointer(region string) *configv1.SnapshotPointer {
	r.t.Helper()
	ctx := context.Background()
	kv, err := r.js.KeyValue(ctx, wire.PointerBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil
	}
	require.NoError(r.t, err)
	e, err := kv.Get(ctx, wire.PointerKey(region))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil
	}
	require.NoError(r.t, err)
	ptr := &configv1.SnapshotPointer{}
	require.NoError(r.t, proto.Unmarshal(e.Value(), ptr))
	return ptr
}

// settled waits until everything of rn's database is published and
// region's pointer names a snapshot holding the last outbox row.
func (r *epochRig) settled(rn *running, region string) *configv1.SnapshotPointer {
	r.t.Helper()
	var ptr *configv1.SnapshotPointer
	deadline := time.Now().Add(15 * time.Second)
	for {
		head, err := rn.st.OutboxHead(context.Background())
		require.NoError(r.t, err)
		var pending int
		require.NoError(r.t, rn.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&pending))
		if ptr = r.pointer(region); ptr != nil && pending == 0 && ptr.GetEventsSeq() == uint64(head) {
			return ptr
		}
		require.False(r.t, time.Now().After(deadline), "not settled: pointer %v, outbox head %d, %d pending", ptr, head, pending)
		time.Sleep(10 * time.Millisecond)
	}
}

// stream reads region's whole event stream.
func (r *epochRig) stream(region string) []*configv1.RegionEvent {
	r.t.Helper()
	ctx := context.Background()
	s, err := r.js.Stream(ctx, wire.EventStream(region))
	require.NoError(r.t, err)
	info, err := s.Info(ctx)
	require.NoError(r.t, err)
	var out []*configv1.RegionEvent
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		require.NoError(r.t, err)
		re := &configv1.RegionEvent{}
		require.NoError(r.t, proto.Unmarshal(m.Data, re))
		require.Equal(r.t, seq, re.GetRegionSeq(), "region_seq is the stream sequence")
		out = append(out, re)
	}
	return out
}

// snapshot fetches and verifies the snapshot ptr names.
func (r *epochRig) snapshot(ptr *configv1.SnapshotPointer) *configv1.Snapshot {
	r.t.Helper()
	obs, err := r.js.ObjectStore(context.Background(), wire.SnapshotBucket)
	require.NoError(r.t, err)
	body, err := obs.GetBytes(context.Background(), ptr.GetObject())
	require.NoError(r.t, err)
	snap, err := wire.DecodeSnapshot(body, ptr)
	require.NoError(r.t, err)
	return snap
}

var testActor = store.Actor{ID: "test"}

// mkRegion creates region with policy, as UpsertRegion does.
func mkRegion(t *testing.T, st *store.Store, name, policy string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
		if err := tx.RegionInsert(ctx, &store.Region{Name: name, Policy: policy}); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionCreated, "region", name, "", "", nil, []byte(`{}`)); err != nil {
			return err
		}
		return tx.Outbox(ctx, store.OutboxEvent{Kind: string(events.RegionPointer), ObjectType: "region", ObjectID: name})
	}))
}

// mkKey creates an org-level key (and its org when orgID is "") through
// a store mutation, as the admin API would.
func mkKey(t *testing.T, st *store.Store, orgID string) (string, string) {
	t.Helper()
	ctx := context.Background()
	if orgID == "" {
		orgID = ids.New("org")
		require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
			if err := tx.OrgInsert(ctx, &store.Org{ID: orgID, Name: orgID}); err != nil {
				return err
			}
			if err := tx.Audit(ctx, audit.ActionCreated, "org", orgID, orgID, "", nil, []byte(`{}`)); err != nil {
				return err
			}
			return tx.Outbox(ctx, store.OutboxEvent{Kind: string(events.OrgUpserted), OrgID: orgID, ObjectType: "org", ObjectID: orgID})
		}))
	}
	keyID := ids.New("key")
	hash := make([]byte, 32)
	_, _ = rand.Read(hash)
	require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
		if err := tx.KeyInsert(ctx, &store.Key{ID: keyID, OrgID: orgID},
			store.KeySecret{Hash: hash, PepperVersion: 1, DisplayPrefix: "sk-sluice-x", Last4: "abcd"}); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionCreated, "key", keyID, orgID, "", nil, []byte(`{}`)); err != nil {
			return err
		}
		return tx.Outbox(ctx, store.OutboxEvent{Kind: string(events.KeyUpserted), OrgID: orgID, ObjectType: "key", ObjectID: keyID})
	}))
	return orgID, keyID
}

// setKey blocks, unblocks or deletes key id.
func setKey(t *testing.T, st *store.Store, id, what string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, st.Mutate(ctx, testActor, func(tx *store.Tx) error {
		k, err := tx.KeyGetForUpdate(ctx, store.Tenant{}, id)
		if err != nil {
			return err
		}
		kind := "key." + what
		switch what {
		case "blocked", "unblocked":
			err = tx.KeySetBlocked(ctx, &k, what == "blocked")
		case "deleted":
			err = tx.KeyDelete(ctx, id)
		}
		if err != nil {
			return err
		}
		if err := tx.Audit(ctx, what, "key", id, k.OrgID, "", []byte(`{}`), []byte(`{}`)); err != nil {
			return err
		}
		return tx.Outbox(ctx, store.OutboxEvent{Kind: kind, OrgID: k.OrgID, ObjectType: "key", ObjectID: id})
	}))
}

func keyBlocked(t *testing.T, st *store.Store, id string) bool {
	t.Helper()
	k, err := st.ConfigKeyGet(context.Background(), id)
	require.NoError(t, err)
	return k.Blocked
}

func snapKey(snap *configv1.Snapshot, id string) *configv1.Key {
	for _, k := range snap.GetKeys() {
		if k.GetId() == id {
			return k
		}
	}
	return nil
}

func lastStreamSeq(t *testing.T, js jetstream.JetStream, region string) uint64 {
	t.Helper()
	s, err := js.Stream(context.Background(), wire.EventStream(region))
	require.NoError(t, err)
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	return info.State.LastSeq
}

// TestEpochAfterRestoreFromBackup: the control plane is switched from
// database A to a backup of A taken earlier while NATS keeps everything A
// published. The new leader must number above what JetStream holds (a
// new epoch), point every region, staged ones too, at its first version,
// continue each stream after its last message with event sequences above
// any the data planes saw, and re-apply the revocations A issued after
// the backup. A second leader on the same database starts no second
// epoch.
func TestEpochAfterRestoreFromBackup(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	ctx := context.Background()
	dbA := testsvc.NewDatabase(t)
	a := r.start(dbA)
	org, k1 := mkKey(t, a.st, "")
	_, k2 := mkKey(t, a.st, org)
	_, k5 := mkKey(t, a.st, org)
	mkRegion(t, a.st, "canary", store.RolloutStaged)
	r.settled(a, "default")
	require.NotNil(t, r.pointer("canary"))

	backup := testsvc.BackupRestore(t, dbA)

	// After the backup, A blocks k1, deletes k2, blocks and unblocks k5
	// and creates k3; several snapshots are compiled.
	setKey(t, a.st, k1, "blocked")
	r.settled(a, "default")
	setKey(t, a.st, k2, "deleted")
	setKey(t, a.st, k5, "blocked")
	setKey(t, a.st, k5, "unblocked")
	_, k3 := mkKey(t, a.st, org)
	ptrA := r.settled(a, "default")
	headA, err := a.st.OutboxHead(ctx)
	require.NoError(t, err)
	lastA := lastStreamSeq(t, r.js, "default")
	canaryA := lastStreamSeq(t, r.js, "canary")
	require.Greater(t, ptrA.GetVersion(), uint64(2))
	a.stop()

	b := r.start(backup)
	var ptr *configv1.SnapshotPointer
	require.Eventually(t, func() bool {
		ptr = r.pointer("default")
		return ptr != nil && ptr.GetVersion() > ptrA.GetVersion()
	}, 15*time.Second, 10*time.Millisecond, "the restored database's snapshot never got a version above A's %d", ptrA.GetVersion())
	ptr = r.settled(b, "default")

	ep, ok, err := b.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.True(t, ok, "an epoch was started")
	require.EqualValues(t, 1, ep.Epoch)
	require.EqualValues(t, ptrA.GetVersion(), ep.VersionFloor, "versions continue above the highest JetStream held")
	require.EqualValues(t, headA, ep.EventsFloor, "event sequences continue above the highest JetStream held")
	require.EqualValues(t, ptrA.GetVersion()+1, ep.FirstVersion)
	require.Contains(t, ep.Reason, "above this database's highest version")
	require.EqualValues(t, lastA, ep.Detail.Regions["default"].StreamSeq)
	require.EqualValues(t, 1, b.p.Stats().EpochsStarted)

	// Revocations of the abandoned history are re-applied; what A lifted
	// again (k5) or created (k3) is not.
	require.True(t, keyBlocked(t, b.st, k1), "k1, blocked after the backup, is blocked again")
	require.True(t, keyBlocked(t, b.st, k2), "k2, deleted after the backup, is blocked")
	require.False(t, keyBlocked(t, b.st, k5), "k5 was unblocked again after its block")
	_, err = b.st.ConfigKeyGet(ctx, k3)
	require.ErrorIs(t, err, store.ErrNotFound)
	require.Len(t, ep.Detail.Reapplied, 2, "%v", ep.Detail.Reapplied)
	var actor string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT actor FROM audit_log WHERE action = 'blocked' AND object_id = $1`, k2).Scan(&actor))
	require.Equal(t, store.EpochActor, actor)
	var epochAudits int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM audit_log WHERE action = 'epoch_started'`).Scan(&epochAudits))
	require.Equal(t, 1, epochAudits)

	// The snapshot the regions now run holds the restored state with the
	// re-applied blocks.
	snap := r.snapshot(ptr)
	require.True(t, snapKey(snap, k1).GetBlocked())
	require.True(t, snapKey(snap, k2).GetBlocked())
	require.Nil(t, snapKey(snap, k3))
	// Every region, the staged canary too, runs the epoch's versions.
	canary := r.pointer("canary")
	require.GreaterOrEqual(t, canary.GetVersion(), uint64(ep.FirstVersion))
	require.GreaterOrEqual(t, canary.GetRegionSeq(), canaryA)

	// The streams go on after their last message, every new event above
	// A's last sequence: nothing a data plane saw is numbered again.
	evs := r.stream("default")
	require.Greater(t, len(evs), int(lastA), "the re-applied blocks were appended")
	for _, re := range evs[lastA:] {
		require.Greater(t, re.GetEvent().GetSeq(), uint64(headA))
	}
	require.Equal(t, uint64(len(evs)), ptr.GetRegionSeq())

	// A change now goes out normally.
	_, k4 := mkKey(t, b.st, org)
	ptr = r.settled(b, "default")
	require.NotNil(t, snapKey(r.snapshot(ptr), k4))
	evs = r.stream("default")
	require.Equal(t, k4, evs[len(evs)-1].GetEvent().GetKey().GetId())

	// A later leader on the same database starts no second epoch.
	b.stop()
	c := r.start(backup)
	setKey(t, c.st, k4, "blocked")
	r.settled(c, "default")
	ep2, _, err := c.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, ep2.Epoch)
	require.Zero(t, c.p.Stats().EpochsStarted)
}

// TestEpochOnEmptyDatabase: a control plane pointed at an empty database
// while NATS holds another's history numbers above it too. A region
// created again in the new database continues its stream after the other
// history's events.
func TestEpochOnEmptyDatabase(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	ctx := context.Background()
	a := r.start(testsvc.NewDatabase(t))
	mkRegion(t, a.st, "eu", store.RolloutAuto)
	org, k1 := mkKey(t, a.st, "")
	setKey(t, a.st, k1, "blocked")
	_, _ = mkKey(t, a.st, org)
	ptrA := r.settled(a, "default")
	r.settled(a, "eu")
	euA := lastStreamSeq(t, r.js, "eu")
	require.Positive(t, euA)
	headA, err := a.st.OutboxHead(ctx)
	require.NoError(t, err)
	lastA := lastStreamSeq(t, r.js, "default")
	a.stop()

	b := r.start(testsvc.NewDatabase(t))
	var ptr *configv1.SnapshotPointer
	require.Eventually(t, func() bool {
		ptr = r.pointer("default")
		return ptr != nil && ptr.GetVersion() > ptrA.GetVersion()
	}, 15*time.Second, 10*time.Millisecond)
	ep, ok, err := b.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	require.EqualValues(t, ptrA.GetVersion()+1, ep.FirstVersion)
	require.Empty(t, ep.Detail.Reapplied, "nothing of A exists here to re-block")
	require.Equal(t, lastA, ptr.GetRegionSeq(), "the stream continues after A's last event")
	require.EqualValues(t, headA, ptr.GetEventsSeq(), "the snapshot claims every sequence A handed out")
	require.Empty(t, r.snapshot(ptr).GetKeys())

	_, k := mkKey(t, b.st, "")
	ptr = r.settled(b, "default")
	require.NotNil(t, snapKey(r.snapshot(ptr), k))
	evs := r.stream("default")
	require.Greater(t, evs[len(evs)-1].GetEvent().GetSeq(), uint64(headA))

	// The region eu, created again: its pointer records the stream's
	// position, its events follow A's, and no second epoch is needed.
	mkRegion(t, b.st, "eu", store.RolloutAuto)
	require.Eventually(t, func() bool {
		p := r.pointer("eu")
		return p != nil && p.GetVersion() > ptrA.GetVersion()
	}, 15*time.Second, 10*time.Millisecond)
	require.Equal(t, euA, r.pointer("eu").GetRegionSeq())
	setKey(t, b.st, k, "blocked")
	r.settled(b, "eu")
	eu := r.stream("eu")
	require.Len(t, eu, int(euA)+1)
	require.Equal(t, k, eu[euA].GetEvent().GetBlock().GetId())
	ep, _, err = b.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, ep.Epoch)
	require.EqualValues(t, 1, b.p.Stats().EpochsStarted)
}

// TestLeaderCrashWindowIsNotAnEpoch: a leader that appended its batch and
// died before recording it leaves the stream ahead of the database with
// the database's own pending rows; the next leader keeps them and starts
// no epoch. A stream tail that is not the database's own (same sequence,
// another event) is an epoch.
func TestLeaderCrashWindowIsNotAnEpoch(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	ctx := context.Background()
	url := testsvc.NewDatabase(t)
	a := r.start(url)
	org, k1 := mkKey(t, a.st, "")
	r.settled(a, "default")
	a.stop()

	// With no leader: k1's block commits, and its event is in the stream
	// as the dead leader appended it.
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool, nil)
	setKey(t, st, k1, "blocked")
	head, err := st.OutboxHead(ctx)
	require.NoError(t, err)
	last := lastStreamSeq(t, r.js, "default")
	appendEvent := func(seq uint64, kind string, ch *configv1.Event_Block) {
		t.Helper()
		data, err := proto.Marshal(&configv1.RegionEvent{Region: "default", RegionSeq: seq, Event: &configv1.Event{
			Seq: uint64(head), At: timestamppb.Now(), Kind: kind, Security: true, Change: ch}})
		require.NoError(t, err)
		_, err = r.js.Publish(ctx, wire.EventSubject("default"), data, jetstream.WithMsgID(wire.EventMsgID("default", seq)),
			jetstream.WithExpectLastSequence(seq-1))
		require.NoError(t, err)
	}
	appendEvent(last+1, string(events.KeyBlocked), &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: "key", Id: k1, Blocked: true}})

	b := r.start(url)
	ptr := r.settled(b, "default")
	_, ok, err := b.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.False(t, ok, "the crash window is not an epoch")
	require.Equal(t, last+1, lastStreamSeq(t, r.js, "default"), "the appended event is kept, not appended again")
	require.Equal(t, last+1, ptr.GetRegionSeq())
	b.stop()

	// Another pending row, and in the stream at its place an event of the
	// same sequence about something else: another history.
	_, _ = mkKey(t, st, org)
	head, err = st.OutboxHead(ctx)
	require.NoError(t, err)
	appendEvent(last+2, string(events.KeyBlocked), &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: "key", Id: "key_other", Blocked: true}})
	c := r.start(url)
	require.Eventually(t, func() bool {
		_, ok, err := c.st.CurrentEpoch(ctx)
		return err == nil && ok
	}, 15*time.Second, 10*time.Millisecond, "a foreign stream tail must start an epoch")
	ep, _, err := c.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.Contains(t, ep.Reason, "that this database did not publish")
	ptr = r.settled(c, "default")
	ep, _, err = c.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.EqualValues(t, ep.FirstVersion, ptr.GetVersion())
	require.Equal(t, last+2, ptr.GetRegionSeq(), "the new key is in the epoch's snapshot, not appended after the foreign event")
	var unpublished int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&unpublished))
	require.Zero(t, unpublished)
}

// TestFleetAheadStartsEpoch: with the database and JetStream in agreement,
// a heartbeat of a data plane running a version above both (the two were
// restored from backups while the fleet kept running) starts an epoch
// above it; heartbeats within what the database knows start none.
func TestFleetAheadStartsEpoch(t *testing.T) {
	t.Parallel()
	r := newEpochRig(t)
	ctx := context.Background()
	a := r.start(testsvc.NewDatabase(t))
	org, k := mkKey(t, a.st, "")
	ptr := r.settled(a, "default")
	head, err := a.st.OutboxHead(ctx)
	require.NoError(t, err)
	beat := func(version, eventsSeq, regionSeq uint64) {
		t.Helper()
		data, err := proto.Marshal(&configv1.Heartbeat{InstanceId: "dp-1", Region: "default", AppliedVersion: version,
			EventsSeq: eventsSeq, RegionSeq: regionSeq, Health: "ok", At: timestamppb.Now()})
		require.NoError(t, err)
		require.NoError(t, r.nc.Publish(wire.HeartbeatSubject("default", "dp-1"), data))
		require.NoError(t, r.nc.Flush())
	}
	// What the database published: nothing to do.
	beat(ptr.GetVersion(), uint64(head), ptr.GetRegionSeq())
	setKey(t, a.st, k, "blocked")
	r.settled(a, "default")
	_, ok, err := a.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.False(t, ok)

	// A data plane ran version +5, events +7 and stream position +9.
	last := lastStreamSeq(t, r.js, "default")
	beat(ptr.GetVersion()+5, uint64(head)+7, last+9)
	require.Eventually(t, func() bool {
		ep, ok, err := a.st.CurrentEpoch(ctx)
		return err == nil && ok && ep.FirstVersion > 0
	}, 15*time.Second, 10*time.Millisecond, "no epoch after a heartbeat ahead of the database")
	ep, _, err := a.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.Contains(t, ep.Reason, "data plane dp-1 runs snapshot version")
	require.EqualValues(t, ptr.GetVersion()+5, ep.VersionFloor)
	require.EqualValues(t, head+7, ep.EventsFloor)
	ptr = r.settled(a, "default")
	require.Equal(t, last+9, ptr.GetRegionSeq(), "the stream continues after the data plane's position")
	_, k2 := mkKey(t, a.st, org)
	r.settled(a, "default")
	evs := r.stream("default")
	got := evs[len(evs)-1]
	require.Equal(t, last+10, got.GetRegionSeq())
	require.Equal(t, k2, got.GetEvent().GetKey().GetId())
	require.Greater(t, got.GetEvent().GetSeq(), uint64(head)+7)

	// Its heartbeats from before it loads the epoch's snapshot start no
	// second epoch.
	beat(ptr.GetVersion()-1, uint64(head)+7, last+9)
	setKey(t, a.st, k2, "blocked")
	r.settled(a, "default")
	ep, _, err = a.st.CurrentEpoch(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, ep.Epoch)
	require.EqualValues(t, 1, a.p.Stats().EpochsStarted)
}
