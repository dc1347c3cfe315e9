package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// ConfigKey is a key as the data planes need it: with its current hash and
// the hashes of rotated-out tokens still in their grace period.
type ConfigKey struct {
	Key
	Hash          []byte
	PepperVersion int
	OldHashes     []KeyOldHash
}

// ConfigState is the whole configuration at one position of the event
// log: it includes exactly the outbox rows with seq ≤ EventsSeq.
type ConfigState struct {
	EventsSeq int64
	Orgs      []Org
	Teams     []Team
	Users     []User
	Members   []TeamMember
	Customers []Customer
	// LabelScopes are the project and tag scopes of every org.
	LabelScopes []LabelScope
	// Issuers are the trusted JWT issuers of every org.
	Issuers []TrustedIssuer
	Keys    []ConfigKey
	// ModelGroups in name order; Deployments in id order, credentials
	// sealed as stored.
	ModelGroups []ModelGroup
	Deployments []Deployment
}

func configKeyFromRow(r dbsqlc.Key, old []dbsqlc.KeyOldHash) (ConfigKey, error) {
	k, err := keyFromRow(r)
	if err != nil {
		return ConfigKey{}, err
	}
	ck := ConfigKey{Key: k, Hash: r.TokenHash, PepperVersion: int(r.PepperVersion)}
	for _, o := range old {
		ck.OldHashes = append(ck.OldHashes, KeyOldHash{Hash: o.TokenHash, PepperVersion: int(o.PepperVersion), ValidUntil: o.ValidUntil})
	}
	return ck, nil
}

// ConfigState reads the whole configuration in one consistent snapshot
// (repeatable read): EventsSeq is the outbox position it matches.
func (s *Store) ConfigState(ctx context.Context) (ConfigState, error) {
	var st ConfigState
	tx, err := s.pool.BeginTx(ctx, pgxRepeatableReadRO)
	if err != nil {
		return st, fmt.Errorf("begin config read: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	head, err := s.q.ChainHeadGet(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read chain head: %w", err)
	}
	st.EventsSeq = head.OutboxSeq
	orgs, err := s.q.ConfigOrgs(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read orgs: %w", err)
	}
	for _, r := range orgs {
		o, err := orgFromRow(r)
		if err != nil {
			return st, err
		}
		st.Orgs = append(st.Orgs, o)
	}
	teams, err := s.q.ConfigTeams(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read teams: %w", err)
	}
	for _, r := range teams {
		t, err := teamFromRow(r)
		if err != nil {
			return st, err
		}
		st.Teams = append(st.Teams, t)
	}
	users, err := s.q.ConfigUsers(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read users: %w", err)
	}
	for _, r := range users {
		u, err := userFromRow(r)
		if err != nil {
			return st, err
		}
		st.Users = append(st.Users, u)
	}
	members, err := s.q.ConfigMembers(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read members: %w", err)
	}
	for _, r := range members {
		st.Members = append(st.Members, teamMemberFromRow(r))
	}
	customers, err := s.q.ConfigCustomers(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read customers: %w", err)
	}
	for _, r := range customers {
		c, err := customerFromRow(r)
		if err != nil {
			return st, err
		}
		st.Customers = append(st.Customers, c)
	}
	labels, err := s.q.ConfigLabelScopes(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read label scopes: %w", err)
	}
	for _, r := range labels {
		st.LabelScopes = append(st.LabelScopes, labelScopeFromRow(r))
	}
	issuers, err := s.q.ConfigTrustedIssuers(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read trusted issuers: %w", err)
	}
	for _, r := range issuers {
		st.Issuers = append(st.Issuers, trustedIssuerFromRow(r))
	}
	old, err := s.q.ConfigOldHashes(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read old key hashes: %w", err)
	}
	oldByKey := map[string][]dbsqlc.KeyOldHash{}
	for _, o := range old {
		oldByKey[o.KeyID] = append(oldByKey[o.KeyID], o)
	}
	keys, err := s.q.ConfigKeys(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read keys: %w", err)
	}
	st.Keys = make([]ConfigKey, 0, len(keys))
	for _, r := range keys {
		k, err := configKeyFromRow(r, oldByKey[r.ID])
		if err != nil {
			return st, err
		}
		st.Keys = append(st.Keys, k)
	}
	groups, err := s.q.ModelGroupAll(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read model groups: %w", err)
	}
	grants, err := s.q.ModelGroupGrantAll(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read model group grants: %w", err)
	}
	grantsOf := map[string][]string{}
	for _, g := range grants {
		grantsOf[g.ModelGroup] = append(grantsOf[g.ModelGroup], g.OrgID)
	}
	st.ModelGroups = make([]ModelGroup, len(groups))
	for i, r := range groups {
		st.ModelGroups[i] = modelGroupFromRow(r)
		st.ModelGroups[i].OrgIDs = grantsOf[r.Name]
	}
	deps, err := s.q.DeploymentAll(ctx, tx)
	if err != nil {
		return st, fmt.Errorf("read deployments: %w", err)
	}
	if st.Deployments, err = deploymentsFromRows(deps); err != nil {
		return st, err
	}
	return st, nil
}

// ConfigKeyGet returns one key with its hashes, or ErrNotFound.
func (s *Store) ConfigKeyGet(ctx context.Context, id string) (ConfigKey, error) {
	r, err := s.q.ConfigKey(ctx, s.pool, id)
	if err != nil {
		return ConfigKey{}, orNotFound(err, "key "+id)
	}
	old, err := s.q.ConfigKeyOldHashes(ctx, s.pool, id)
	if err != nil {
		return ConfigKey{}, fmt.Errorf("read old key hashes: %w", err)
	}
	return configKeyFromRow(r, old)
}

// ConfigMemberGet returns one membership, or ErrNotFound.
func (s *Store) ConfigMemberGet(ctx context.Context, teamID, userID string) (TeamMember, error) {
	r, err := s.q.ConfigMember(ctx, s.pool, dbsqlc.ConfigMemberParams{TeamID: teamID, UserID: userID})
	if err != nil {
		return TeamMember{}, orNotFound(err, "member "+teamID+"/"+userID)
	}
	return teamMemberFromRow(r), nil
}

// OutboxRow is one pending change for the data planes.
type OutboxRow struct {
	Seq        int64
	At         time.Time
	Kind       string
	OrgID      string
	ObjectType string
	ObjectID   string
	Payload    []byte
}

// RegionState is a region as the publisher sees it.
type RegionState struct {
	Name           string
	Policy         string // "auto" or "staged"
	RegionSeq      int64
	CurrentVersion int64
	Rollback       bool
}

func regionStateFromRow(r dbsqlc.Region) RegionState {
	return RegionState{Name: r.Name, Policy: r.Policy, RegionSeq: r.RegionSeq, CurrentVersion: r.CurrentVersion, Rollback: r.Rollback}
}

// PublishFunc publishes rows (in seq order) given the regions' stream
// positions; it returns each region's new position. If it fails, nothing
// is marked published.
type PublishFunc func(ctx context.Context, rows []OutboxRow, regions []RegionState) (map[string]int64, error)

// PublishPending runs fn over up to limit unpublished outbox rows inside a
// transaction that locks the regions and the rows, then marks the rows
// published and stores the regions' new stream positions. Concurrent
// callers (two control-plane replicas) serialise on the locks, so no row
// is published twice in different orders. It returns how many rows it
// published.
func (s *Store) PublishPending(ctx context.Context, limit int, fn PublishFunc) (int, error) {
	n := 0
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		regs, err := s.q.ConfigRegionsLock(ctx, tx)
		if err != nil {
			return fmt.Errorf("lock regions: %w", err)
		}
		rows, err := s.q.ConfigOutboxPending(ctx, tx, int32(limit))
		if err != nil {
			return fmt.Errorf("read outbox: %w", err)
		}
		if len(rows) == 0 {
			return nil
		}
		regions := make([]RegionState, len(regs))
		for i, r := range regs {
			regions[i] = regionStateFromRow(r)
		}
		out := make([]OutboxRow, len(rows))
		for i, r := range rows {
			out[i] = OutboxRow{Seq: r.Seq, At: r.At, Kind: r.Kind, OrgID: r.OrgID, ObjectType: r.ObjectType, ObjectID: r.ObjectID, Payload: r.Payload}
		}
		seqs, err := fn(ctx, out, regions)
		if err != nil {
			return err
		}
		for _, r := range regions {
			if v, ok := seqs[r.Name]; ok && v != r.RegionSeq {
				if err := s.q.ConfigRegionSetSeq(ctx, tx, dbsqlc.ConfigRegionSetSeqParams{Name: r.Name, RegionSeq: v}); err != nil {
					return fmt.Errorf("store region position: %w", err)
				}
			}
		}
		now := s.Now()
		if err := s.q.ConfigOutboxMarkPublished(ctx, tx, dbsqlc.ConfigOutboxMarkPublishedParams{PublishedAt: &now, UpTo: out[len(out)-1].Seq}); err != nil {
			return fmt.Errorf("mark outbox published: %w", err)
		}
		n = len(out)
		return nil
	})
	return n, err
}

// Regions returns every region.
func (s *Store) Regions(ctx context.Context) ([]RegionState, error) {
	regs, err := s.q.ConfigRegions(ctx, s.pool)
	if err != nil {
		return nil, fmt.Errorf("read regions: %w", err)
	}
	out := make([]RegionState, len(regs))
	for i, r := range regs {
		out[i] = regionStateFromRow(r)
	}
	return out, nil
}

// VersionRecord describes a compiled snapshot.
type VersionRecord struct {
	Version   int64
	EventsSeq int64
	Digest    []byte
	Size      int64
	Object    string
	CreatedAt time.Time
}

// NextConfigVersion returns the number the next compiled snapshot gets:
// above every compiled version and above the current epoch's floor.
func (s *Store) NextConfigVersion(ctx context.Context) (int64, error) {
	v, err := s.q.ConfigVersionFloor(ctx, s.pool)
	if err != nil {
		return 0, fmt.Errorf("read config versions: %w", err)
	}
	return v + 1, nil
}

// RecordConfigVersion stores a compiled version with each region's stream
// position at compile time, and makes it current in every auto region (and
// in regions that run nothing yet). The first version of an epoch becomes
// current in every region, staged ones too: what they ran belongs to the
// abandoned history. It returns the regions whose current version changed.
func (s *Store) RecordConfigVersion(ctx context.Context, v VersionRecord, regionSeqs map[string]int64) ([]string, error) {
	var changed []string
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		changed = changed[:0]
		err := s.q.ConfigVersionInsert(ctx, tx, dbsqlc.ConfigVersionInsertParams{
			Version: v.Version, EventsSeq: v.EventsSeq, Digest: v.Digest, SizeBytes: v.Size, Object: v.Object, CreatedAt: v.CreatedAt,
		})
		if err != nil {
			return fmt.Errorf("insert config version: %w", err)
		}
		regs, err := s.q.ConfigRegionsLock(ctx, tx)
		if err != nil {
			return fmt.Errorf("lock regions: %w", err)
		}
		baseline := false
		switch ep, err := s.q.EpochLatestForUpdate(ctx, tx); {
		case isNoRows(err):
		case err != nil:
			return fmt.Errorf("read distribution epoch: %w", err)
		case ep.FirstVersion == nil:
			if v.Version <= ep.VersionFloor {
				return fmt.Errorf("config version %d is not above epoch %d's floor %d", v.Version, ep.Epoch, ep.VersionFloor)
			}
			baseline = true
			if err := s.q.EpochSetFirstVersion(ctx, tx, dbsqlc.EpochSetFirstVersionParams{Epoch: ep.Epoch, FirstVersion: &v.Version}); err != nil {
				return fmt.Errorf("record epoch's first version: %w", err)
			}
		}
		for _, r := range regs {
			seq, ok := regionSeqs[r.Name]
			if !ok {
				continue // region created after compilation started; the next version covers it
			}
			if err := s.q.ConfigVersionRegionInsert(ctx, tx, dbsqlc.ConfigVersionRegionInsertParams{Version: v.Version, Region: r.Name, RegionSeq: seq}); err != nil {
				return fmt.Errorf("insert version position: %w", err)
			}
			if r.Policy == "auto" || r.CurrentVersion == 0 || baseline {
				if err := s.q.ConfigRegionSetCurrent(ctx, tx, dbsqlc.ConfigRegionSetCurrentParams{Name: r.Name, CurrentVersion: v.Version, UpdatedAt: s.Now()}); err != nil {
					return fmt.Errorf("set region version: %w", err)
				}
				changed = append(changed, r.Name)
			}
		}
		return nil
	})
	return changed, err
}

// Pointer is what a region's KV entry says.
type Pointer struct {
	Version   int64
	Digest    []byte
	EventsSeq int64
	RegionSeq int64
	Object    string
	Rollback  bool
}

// ErrNoPosition means a region has no recorded stream position for its
// current version (it was created after the version was compiled).
var ErrNoPosition = errors.New("region has no position for its version")

// RegionPointer returns the pointer region should publish: its current
// version and its stream position at that version's compilation.
func (s *Store) RegionPointer(ctx context.Context, region string) (Pointer, error) {
	var p Pointer
	var r dbsqlc.Region
	regs, err := s.q.ConfigRegions(ctx, s.pool)
	if err != nil {
		return p, fmt.Errorf("read regions: %w", err)
	}
	found := false
	for _, x := range regs {
		if x.Name == region {
			r, found = x, true
		}
	}
	if !found {
		return p, notFound("region " + region)
	}
	if r.CurrentVersion == 0 {
		return p, ErrNoPosition
	}
	v, err := s.q.ConfigVersionByNumber(ctx, s.pool, r.CurrentVersion)
	if err != nil {
		return p, orNotFound(err, fmt.Sprintf("config version %d", r.CurrentVersion))
	}
	seq, err := s.q.ConfigVersionRegionSeq(ctx, s.pool, dbsqlc.ConfigVersionRegionSeqParams{Version: r.CurrentVersion, Region: region})
	if isNoRows(err) {
		return p, ErrNoPosition
	}
	if err != nil {
		return p, fmt.Errorf("read region position: %w", err)
	}
	return Pointer{Version: v.Version, Digest: v.Digest, EventsSeq: v.EventsSeq, RegionSeq: seq, Object: v.Object, Rollback: r.Rollback}, nil
}
