package publish

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Distribution epochs (docs/distribution.md "Backup and restore").
//
// Postgres is the source of every number the data planes see: snapshot
// versions (config_versions), event sequences (the outbox) and each
// region's stream position (regions.region_seq). When the database is
// restored from a backup, or replaced by another, while NATS keeps its
// data, JetStream holds numbers the database never handed out: pointers to
// higher versions, events with higher sequences, streams longer than the
// database's positions. A data plane refuses a snapshot with a lower
// version than it runs, and skips events it believes it has seen, so
// publishing from the database's own numbers would reach nobody.
//
// Whenever it becomes leader, the publisher compares the two. If
// JetStream is ahead it starts an epoch (store.StartEpoch): versions go on
// above the highest one JetStream holds, outbox sequences above its
// highest event, each region's stream after its last message; the epoch's
// first snapshot becomes current in every region. Revocations of the
// abandoned history that the database lacks are re-applied (reapply).
//
// A leader that died between appending events and recording the new
// region position also leaves a stream ahead of the database; those
// events are the database's own pending outbox rows (same sequence, kind
// and object), which appendedBefore accepts. That window is not an epoch.

// streamPos is a region stream's extent in JetStream.
type streamPos struct {
	firstSeq, lastSeq uint64
	// lastEventSeq is the outbox sequence of the stream's last message (0
	// when it has none or it does not decode).
	lastEventSeq uint64
}

// jetStreamState is what JetStream holds of the distribution.
type jetStreamState struct {
	// pointers is each region key's latest pointer.
	pointers map[string]*configv1.SnapshotPointer
	// maxPointerVersion is the highest version any pointer (in the KV
	// history) names, in region maxPointerRegion.
	maxPointerVersion uint64
	maxPointerRegion  string
	// maxObjectVersion is the highest snapshot object's version (read by
	// startEpoch).
	maxObjectVersion uint64
	// maxEventsSeq is the highest event sequence of any pointer or the
	// last message of any region stream.
	maxEventsSeq uint64
	streams      map[string]streamPos
}

// readJetStream reads the pointer bucket (with history) and every region
// stream's extent.
func (p *Publisher) readJetStream(ctx context.Context) (jetStreamState, error) {
	js := jetStreamState{pointers: map[string]*configv1.SnapshotPointer{}, streams: map[string]streamPos{}}
	kv, err := p.js.KeyValue(ctx, wire.PointerBucket)
	if err != nil {
		return js, fmt.Errorf("pointer bucket: %w", err)
	}
	lister, err := kv.ListKeys(ctx)
	if err != nil {
		return js, fmt.Errorf("list pointers: %w", err)
	}
	var keys []string
	for k := range lister.Keys() {
		keys = append(keys, k)
	}
	_ = lister.Stop()
	for _, key := range keys {
		region, ok := strings.CutPrefix(key, wire.PointerKey(""))
		if !ok {
			continue
		}
		hist, err := kv.History(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return js, fmt.Errorf("read pointer history of region %s: %w", region, err)
		}
		for i, e := range hist {
			if e.Operation() != jetstream.KeyValuePut {
				continue
			}
			ptr := &configv1.SnapshotPointer{}
			if proto.Unmarshal(e.Value(), ptr) != nil {
				continue
			}
			if ptr.GetVersion() > js.maxPointerVersion {
				js.maxPointerVersion, js.maxPointerRegion = ptr.GetVersion(), region
			}
			js.maxEventsSeq = max(js.maxEventsSeq, ptr.GetEventsSeq())
			if i == len(hist)-1 {
				js.pointers[region] = ptr
			}
		}
	}
	names := p.js.StreamNames(ctx, jetstream.WithStreamListSubject(wire.EventSubject(">")))
	var streams []string
	for n := range names.Name() {
		streams = append(streams, n)
	}
	if err := names.Err(); err != nil {
		return js, fmt.Errorf("list event streams: %w", err)
	}
	for _, name := range streams {
		region, ok := strings.CutPrefix(name, wire.EventStream(""))
		if !ok {
			continue
		}
		st, err := p.js.Stream(ctx, name)
		if err != nil {
			return js, fmt.Errorf("event stream of region %s: %w", region, err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			return js, fmt.Errorf("event stream of region %s: %w", region, err)
		}
		pos := streamPos{firstSeq: info.State.FirstSeq, lastSeq: info.State.LastSeq}
		if info.State.Msgs > 0 {
			m, err := st.GetLastMsgForSubject(ctx, wire.EventSubject(region))
			if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
				return js, fmt.Errorf("last event of region %s: %w", region, err)
			}
			re := &configv1.RegionEvent{}
			if m != nil && proto.Unmarshal(m.Data, re) == nil {
				pos.lastEventSeq = re.GetEvent().GetSeq()
			}
		}
		js.maxEventsSeq = max(js.maxEventsSeq, pos.lastEventSeq)
		js.streams[region] = pos
	}
	return js, nil
}

// fleetSeen is the highest numbers data-plane heartbeats reported: the
// version they run, the last event applied, and per region the last
// stream position applied (with the instance that reported each).
type fleetSeen struct {
	version, eventsSeq      uint64
	versionFrom, eventsFrom string
	regionSeq               map[string]uint64
	regionFrom              map[string]string
}

// seeHeartbeat records what a data plane runs and wakes the leader when
// that goes beyond anything seen before.
func (p *Publisher) seeHeartbeat(m *nats.Msg) {
	hb := &configv1.Heartbeat{}
	if proto.Unmarshal(m.Data, hb) != nil || !wire.ValidRegion(hb.GetRegion()) || hb.GetAppliedVersion() == 0 ||
		hb.GetAppliedVersion() > math.MaxInt64 || hb.GetEventsSeq() > math.MaxInt64 || hb.GetRegionSeq() > math.MaxInt64 {
		return
	}
	id := hb.GetInstanceId()
	if hb.GetAppliedVersion() <= uint64(p.epochFloor.Load()) {
		// Runs a version of an abandoned history: its positions are
		// replaced by the epoch's first snapshot as soon as it loads it.
		return
	}
	p.fleetMu.Lock()
	raised := false
	f := &p.fleet
	if hb.GetAppliedVersion() > f.version {
		f.version, f.versionFrom, raised = hb.GetAppliedVersion(), id, true
	}
	if hb.GetEventsSeq() > f.eventsSeq {
		f.eventsSeq, f.eventsFrom, raised = hb.GetEventsSeq(), id, true
	}
	if r := hb.GetRegion(); hb.GetRegionSeq() > f.regionSeq[r] {
		f.regionSeq[r], f.regionFrom[r], raised = hb.GetRegionSeq(), id, true
	}
	p.fleetMu.Unlock()
	if raised {
		select {
		case p.fleetRaised <- struct{}{}:
		default:
		}
	}
}

func (p *Publisher) fleetSnapshot() fleetSeen {
	p.fleetMu.Lock()
	defer p.fleetMu.Unlock()
	f := p.fleet
	f.regionSeq, f.regionFrom = maps.Clone(f.regionSeq), maps.Clone(f.regionFrom)
	return f
}

// fleetAhead is the cheap test of the fleet's numbers against the
// database (and, for stream positions, JetStream): whether checkEpoch
// has anything to find.
func (p *Publisher) fleetAhead(ctx context.Context) (bool, error) {
	f := p.fleetSnapshot()
	next, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return false, err
	}
	head, err := p.store.OutboxHead(ctx)
	if err != nil {
		return false, err
	}
	if f.version >= uint64(next) || f.eventsSeq > uint64(head) {
		return true, nil
	}
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	for _, r := range regions {
		if f.regionSeq[r.Name] <= uint64(r.RegionSeq) {
			continue
		}
		// Beyond the database, but maybe in the stream: a leader that died
		// between its appends and recording them.
		last, err := p.streamLast(ctx, r.Name)
		if err != nil {
			return false, err
		}
		if f.regionSeq[r.Name] > last {
			return true, nil
		}
	}
	return false, nil
}

func (p *Publisher) streamLast(ctx context.Context, region string) (uint64, error) {
	st, err := p.js.Stream(ctx, wire.EventStream(region))
	if err != nil {
		return 0, fmt.Errorf("event stream of region %s: %w", region, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("event stream of region %s: %w", region, err)
	}
	return info.State.LastSeq, nil
}

// maxObjectVersion is the highest version among the snapshot objects
// (read only when an epoch starts: the store keeps every snapshot).
func (p *Publisher) maxObjectVersion(ctx context.Context) (uint64, error) {
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	if err != nil {
		return 0, fmt.Errorf("snapshot bucket: %w", err)
	}
	objs, err := obs.List(ctx)
	if err != nil && !errors.Is(err, jetstream.ErrNoObjectsFound) {
		return 0, fmt.Errorf("list snapshots: %w", err)
	}
	var top uint64
	for _, o := range objs {
		if v, ok := strings.CutPrefix(o.Name, "snapshot-"); ok {
			if n, err := strconv.ParseUint(v, 10, 64); err == nil {
				top = max(top, n)
			}
		}
	}
	return top, nil
}

// checkEpoch compares JetStream, and what the data planes report running,
// with the database and starts an epoch when they are ahead (reporting
// whether it did). It runs whenever this replica becomes leader, before
// anything is published, and, with fleetOnly, when a heartbeat shows the
// fleet ahead of the database: then only the fleet being ahead of both
// the database and JetStream counts (JetStream's own evidence was weighed
// when this replica became leader, and the leader's appends are in the
// stream before it records them in the database).
func (p *Publisher) checkEpoch(ctx context.Context, fleetOnly bool) (bool, error) {
	js, err := p.readJetStream(ctx)
	if err != nil {
		return false, err
	}
	fleet := p.fleetSnapshot()
	regions, err := p.store.Regions(ctx)
	if err != nil {
		return false, err
	}
	next, err := p.store.NextConfigVersion(ctx)
	if err != nil {
		return false, err
	}
	dbVersion := uint64(next - 1)
	head, err := p.store.OutboxHead(ctx)
	if err != nil {
		return false, err
	}
	var floor uint64 // versions up to the current epoch's floor are a known earlier history
	if ep, ok, err := p.store.CurrentEpoch(ctx); err != nil {
		return false, err
	} else if ok {
		floor = uint64(ep.VersionFloor)
		p.epochFloor.Store(ep.VersionFloor)
	}

	var reasons []string
	if js.maxPointerVersion > dbVersion {
		reasons = append(reasons, fmt.Sprintf("JetStream points region %s at snapshot version %d, above this database's highest version %d",
			js.maxPointerRegion, js.maxPointerVersion, dbVersion))
	}
	for _, region := range slices.Sorted(maps.Keys(js.pointers)) {
		ptr := js.pointers[region]
		v := ptr.GetVersion()
		if v <= floor || v > dbVersion {
			continue
		}
		digest, ok, err := p.store.ConfigVersionDigest(ctx, int64(v))
		if err != nil {
			return false, err
		}
		switch {
		case !ok:
			reasons = append(reasons, fmt.Sprintf("region %s runs snapshot version %d, which this database never compiled", region, v))
		case string(digest) != string(ptr.GetDigest()):
			reasons = append(reasons, fmt.Sprintf("region %s runs a snapshot version %d that differs from this database's version %d", region, v, v))
		}
	}
	if js.maxEventsSeq > uint64(head) {
		reasons = append(reasons, fmt.Sprintf("JetStream holds config events up to sequence %d, above this database's last event %d", js.maxEventsSeq, head))
	}
	var pending map[int64]store.PendingRow
	for _, r := range regions {
		pos := js.streams[r.Name]
		if pos.lastSeq <= uint64(r.RegionSeq) {
			continue
		}
		if pending == nil {
			rows, err := p.store.PendingOutbox(ctx, batchSize)
			if err != nil {
				return false, err
			}
			pending = map[int64]store.PendingRow{}
			for _, row := range rows {
				pending[row.Seq] = row
			}
		}
		own, err := p.tailIsPending(ctx, r.Name, uint64(r.RegionSeq), pos.lastSeq, pending)
		if err != nil {
			return false, err
		}
		if !own {
			reasons = append(reasons, fmt.Sprintf("region %s's event stream holds events up to position %d that this database did not publish (its position: %d)",
				r.Name, pos.lastSeq, r.RegionSeq))
		}
	}
	// The data planes' numbers: they ran past both (the database and
	// JetStream restored from backups while the fleet kept running).
	if fleetOnly {
		reasons = nil
	}
	if fleet.version > max(dbVersion, js.maxPointerVersion) {
		reasons = append(reasons, fmt.Sprintf("data plane %s runs snapshot version %d, above this database's highest version %d",
			fleet.versionFrom, fleet.version, dbVersion))
	}
	if fleet.eventsSeq > max(uint64(head), js.maxEventsSeq) {
		reasons = append(reasons, fmt.Sprintf("data plane %s applied config events up to sequence %d, above this database's last event %d",
			fleet.eventsFrom, fleet.eventsSeq, head))
	}
	for _, r := range regions {
		if seq, last := fleet.regionSeq[r.Name], js.streams[r.Name].lastSeq; seq > max(uint64(r.RegionSeq), last) {
			reasons = append(reasons, fmt.Sprintf("data plane %s of region %s applied its event stream up to position %d, beyond the stream's last %d",
				fleet.regionFrom[r.Name], r.Name, seq, last))
		}
	}
	if len(reasons) == 0 {
		return false, nil
	}
	return true, p.startEpoch(ctx, js, fleet, regions, dbVersion, head, reasons)
}

// tailIsPending reports whether region's stream messages after the
// database's position from up to to are all this database's pending
// outbox rows: what a leader that died between its appends and recording
// them leaves behind (at most one batch).
func (p *Publisher) tailIsPending(ctx context.Context, region string, from, to uint64, pending map[int64]store.PendingRow) (bool, error) {
	if to-from > batchSize {
		return false, nil
	}
	st, err := p.js.Stream(ctx, wire.EventStream(region))
	if err != nil {
		return false, fmt.Errorf("event stream of region %s: %w", region, err)
	}
	for seq := from + 1; seq <= to; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read event %d of region %s: %w", seq, region, err)
		}
		re := &configv1.RegionEvent{}
		if proto.Unmarshal(m.Data, re) != nil || re.GetRegionSeq() != seq {
			return false, nil
		}
		row, ok := pending[int64(re.GetEvent().GetSeq())]
		if !ok || !eventIsRow(re.GetEvent(), row.Kind, row.ObjectType, row.ObjectID) {
			return false, nil
		}
	}
	return true, nil
}

// eventIsRow reports whether ev was built from the outbox row of kind
// about objectType objectID (the caller compares sequences).
func eventIsRow(ev *configv1.Event, kind, objectType, objectID string) bool {
	if ev.GetKind() != kind {
		return false
	}
	typ, id := eventObject(ev)
	return typ == "" || typ == objectType && id == objectID
}

// eventObject names the object ev is about ("" when it cannot tell).
func eventObject(ev *configv1.Event) (string, string) {
	switch c := ev.GetChange().(type) {
	case *configv1.Event_Block:
		return c.Block.GetObjectType(), c.Block.GetId()
	case *configv1.Event_Org:
		return "org", c.Org.GetId()
	case *configv1.Event_OrgDeleted:
		return "org", c.OrgDeleted
	case *configv1.Event_Team:
		return "team", c.Team.GetId()
	case *configv1.Event_TeamDeleted:
		return "team", c.TeamDeleted
	case *configv1.Event_User:
		return "user", c.User.GetId()
	case *configv1.Event_UserDeleted:
		return "user", c.UserDeleted
	case *configv1.Event_Customer:
		return "customer", c.Customer.GetId()
	case *configv1.Event_CustomerDeleted:
		return "customer", c.CustomerDeleted
	case *configv1.Event_LabelScope:
		return "label_scope", c.LabelScope.GetId()
	case *configv1.Event_LabelScopeDeleted:
		return "label_scope", c.LabelScopeDeleted
	case *configv1.Event_Key:
		return "key", c.Key.GetId()
	case *configv1.Event_KeyDeleted:
		return "key", c.KeyDeleted
	case *configv1.Event_Member:
		return "team_member", c.Member.GetTeamId() + "/" + c.Member.GetUserId()
	case *configv1.Event_MemberDeleted:
		return "team_member", c.MemberDeleted.GetTeamId() + "/" + c.MemberDeleted.GetUserId()
	case *configv1.Event_ModelGroup:
		return "model_group", c.ModelGroup.GetName()
	case *configv1.Event_ModelGroupDeleted:
		return "model_group", c.ModelGroupDeleted
	case *configv1.Event_Deployment:
		return "deployment", c.Deployment.GetId()
	case *configv1.Event_DeploymentDeleted:
		return "deployment", c.DeploymentDeleted
	case *configv1.Event_TrustedIssuer:
		return "trusted_issuer", c.TrustedIssuer.GetId()
	case *configv1.Event_TrustedIssuerDeleted:
		return "trusted_issuer", c.TrustedIssuerDeleted
	}
	return "", ""
}

// startEpoch records a new epoch above everything JetStream holds, then
// re-applies the abandoned history's revocations.
func (p *Publisher) startEpoch(ctx context.Context, js jetStreamState, fleet fleetSeen, regions []store.RegionState, dbVersion uint64, head int64, reasons []string) error {
	var err error
	if js.maxObjectVersion, err = p.maxObjectVersion(ctx); err != nil {
		return err
	}
	in := store.EpochStart{
		VersionFloor: int64(max(js.maxPointerVersion, js.maxObjectVersion, dbVersion, fleet.version)),
		EventsFloor:  int64(max(js.maxEventsSeq, uint64(head), fleet.eventsSeq)),
		StreamSeqs:   map[string]int64{},
		Reason:       strings.Join(reasons, "; "),
		Detail: store.EpochDetail{JetStreamVersion: int64(max(js.maxPointerVersion, js.maxObjectVersion)),
			JetStreamEventsSeq: int64(js.maxEventsSeq), Regions: map[string]store.EpochRegion{}},
	}
	// The abandoned history of each region: its stream after the
	// database's position. Revocations issued after the database's backup
	// live only there; the snapshot compiled next would lift them.
	var events []*configv1.Event
	seen := map[uint64]bool{}
	for _, r := range regions {
		pos := js.streams[r.Name]
		if pos.lastSeq <= uint64(r.RegionSeq) {
			continue
		}
		err := p.readStream(ctx, r.Name, max(uint64(r.RegionSeq)+1, pos.firstSeq), pos.lastSeq, func(re *configv1.RegionEvent) {
			if ev := re.GetEvent(); ev != nil && !seen[ev.GetSeq()] {
				seen[ev.GetSeq()] = true
				events = append(events, ev)
			}
		})
		if err != nil {
			// The epoch goes ahead; what could not be read is reported.
			p.log.Error("could not read the abandoned history for revocations to re-apply", "region", r.Name, "error", err)
		}
	}
	for _, r := range regions {
		pos := js.streams[r.Name]
		seq := pos.lastSeq
		if f := fleet.regionSeq[r.Name]; f > seq {
			// Data planes applied positions the stream no longer has: the
			// region's events continue after theirs.
			st, err := p.js.Stream(ctx, wire.EventStream(r.Name))
			if err != nil {
				return fmt.Errorf("event stream of region %s: %w", r.Name, err)
			}
			if err := st.Purge(ctx, jetstream.WithPurgeSequence(f+1)); err != nil {
				return fmt.Errorf("move event stream of region %s past %d: %w", r.Name, f, err)
			}
			seq = f
		}
		in.StreamSeqs[r.Name] = int64(seq)
		in.Detail.Regions[r.Name] = store.EpochRegion{DatabaseSeq: r.RegionSeq, StreamSeq: int64(seq)}
	}
	ep, err := p.store.StartEpoch(ctx, in)
	if err != nil {
		return fmt.Errorf("start distribution epoch: %w", err)
	}
	p.epochs.Add(1)
	p.epochFloor.Store(ep.VersionFloor)
	p.log.Error("JetStream is ahead of the database (restored or replaced while NATS kept its data): started a new distribution epoch; "+
		"versions and event sequences continue above what JetStream holds",
		"epoch", ep.Epoch, "version_floor", ep.VersionFloor, "events_floor", ep.EventsFloor, "reason", ep.Reason)

	reapplied, unapplied, err := p.reapply(ctx, events)
	if err != nil {
		return err
	}
	if len(reapplied) > 0 || len(unapplied) > 0 {
		if err := p.store.EpochRecordReapplied(ctx, ep.Epoch, reapplied, unapplied); err != nil {
			return err
		}
	}
	return nil
}

// readStream calls fn with region's stream messages from up to to.
func (p *Publisher) readStream(ctx context.Context, region string, from, to uint64, fn func(*configv1.RegionEvent)) error {
	if from > to {
		return nil
	}
	cons, err := p.js.OrderedConsumer(ctx, wire.EventStream(region), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{wire.EventSubject(region)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy, OptStartSeq: from,
	})
	if err != nil {
		return err
	}
	for {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return err
		}
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				return err
			}
			if md.Sequence.Stream > to {
				return nil
			}
			re := &configv1.RegionEvent{}
			if proto.Unmarshal(m.Data(), re) == nil {
				fn(re)
			}
			if md.Sequence.Stream == to {
				return nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return err
		}
		if got == 0 {
			return nil // the rest expired or was deleted
		}
	}
}

// revocation is what the abandoned history last did to an object's
// access.
type revocation struct {
	objectType, id, what string
	seq                  uint64
	at                   time.Time
	revoked              bool // false: the history lifted it again (an unblock)
}

// blockable are the object types whose block denies a key.
var blockable = map[string]bool{"key": true, "user": true, "team": true, "org": true, "customer": true}

// reapply blocks, in this database, every object the abandoned history
// revoked last (blocked, deleted, or a key rotated without grace) and
// that exists here unblocked. Other security events of that history
// (membership, model group and deployment deletions) are reported, not
// re-applied.
func (p *Publisher) reapply(ctx context.Context, events []*configv1.Event) (reapplied, unapplied []string, err error) {
	slices.SortFunc(events, func(a, b *configv1.Event) int { return cmp.Compare(a.GetSeq(), b.GetSeq()) })
	last := map[string]*revocation{}
	var order []string
	note := func(r *revocation) {
		k := r.objectType + " " + r.id
		if _, ok := last[k]; !ok {
			order = append(order, k)
		}
		last[k] = r
	}
	for _, ev := range events {
		typ, id := eventObject(ev)
		if typ == "" || id == "" {
			continue
		}
		r := &revocation{objectType: typ, id: id, seq: ev.GetSeq(), at: ev.GetAt().AsTime()}
		switch c := ev.GetChange().(type) {
		case *configv1.Event_Block:
			r.revoked, r.what = c.Block.GetBlocked(), "blocked"
			if !r.revoked {
				r.what = "unblocked"
			}
		case *configv1.Event_OrgDeleted, *configv1.Event_TeamDeleted, *configv1.Event_UserDeleted,
			*configv1.Event_CustomerDeleted, *configv1.Event_KeyDeleted, *configv1.Event_MemberDeleted,
			*configv1.Event_ModelGroupDeleted, *configv1.Event_DeploymentDeleted, *configv1.Event_TrustedIssuerDeleted:
			r.revoked, r.what = true, "deleted"
		case *configv1.Event_Key:
			if !ev.GetSecurity() {
				continue // a creation or change: not a revocation
			}
			r.revoked, r.what = true, "rotated without grace"
		default:
			continue
		}
		note(r)
	}
	for _, k := range order {
		r := last[k]
		if !r.revoked {
			continue
		}
		desc := fmt.Sprintf("%s %s %s at %s (event %d)", r.objectType, r.id, r.what, r.at.UTC().Format(time.RFC3339), r.seq)
		if !blockable[r.objectType] {
			unapplied = append(unapplied, desc+": not re-applied (only blocks are)")
			continue
		}
		why := "re-applied by distribution epoch: " + desc + " in the history this database does not have"
		ok, err := p.store.ReapplyBlock(ctx, r.objectType, r.id, why)
		if err != nil {
			return nil, nil, fmt.Errorf("re-apply %s: %w", desc, err)
		}
		if ok {
			reapplied = append(reapplied, fmt.Sprintf("%s %s blocked (%s)", r.objectType, r.id, desc))
			p.log.Warn("re-applied a revocation of the abandoned history as a block", "object_type", r.objectType, "id", r.id, "was", r.what, "event_seq", r.seq)
		}
	}
	return reapplied, unapplied, nil
}
