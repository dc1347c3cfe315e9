package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Team is a team inside an org.
type Team struct {
	ID     string
	OrgID  string
	Name   string
	Limits []byte // JSON of sluice.admin.v1.Limits
	// Blocked is changed only through TeamSetBlocked.
	Blocked  bool
	Metadata map[string]string
	// TrafficClass is the stored form of the team's traffic class; "" means
	// unspecified. The admin package owns the mapping to the API enum.
	TrafficClass      string
	ModelGroupAliases map[string]string
	// Fallbacks are the team's per-group fallback overrides; they change
	// only through TeamFallbacksSet.
	Fallbacks Fallbacks
	CreatedAt time.Time
	UpdatedAt time.Time
}

// TeamQuery filters TeamList.
type TeamQuery struct {
	NamePrefix string
	Blocked    *bool
}

func teamFromRow(r dbsqlc.Team) (Team, error) {
	md, err := decodeMetadata(r.Metadata)
	if err != nil {
		return Team{}, err
	}
	aliases, err := decodeMetadata(r.ModelGroupAliases)
	if err != nil {
		return Team{}, fmt.Errorf("decode model group aliases of team %s: %w", r.ID, err)
	}
	fb, err := decodeFallbacks(r.Fallbacks)
	if err != nil {
		return Team{}, fmt.Errorf("decode fallbacks of team %s: %w", r.ID, err)
	}
	return Team{
		Fallbacks: fb,
		ID:        r.ID, OrgID: r.OrgID, Name: r.Name, Limits: r.Limits, Blocked: r.Blocked, Metadata: md,
		TrafficClass: r.TrafficClass, ModelGroupAliases: aliases, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}, nil
}

// TeamGet returns team id if t may see it: an org tenant sees its org's
// teams, a team tenant only its own team.
func (s *Store) TeamGet(ctx context.Context, t Tenant, id string) (Team, error) {
	r, err := s.q.TeamGet(ctx, s.pool, dbsqlc.TeamGetParams{ID: id, OrgID: optStr(t.OrgID), TeamID: optStr(t.TeamID)})
	if err != nil {
		return Team{}, orNotFound(err, "team "+id)
	}
	return teamFromRow(r)
}

// TeamList returns a page of teams visible to t, in id order.
func (s *Store) TeamList(ctx context.Context, t Tenant, q TeamQuery, p Page) ([]Team, error) {
	rows, err := s.q.TeamList(ctx, s.pool, dbsqlc.TeamListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), TeamID: optStr(t.TeamID), NamePrefix: q.NamePrefix,
		Blocked: q.Blocked, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list teams: %w", err)
	}
	out := make([]Team, 0, len(rows))
	for _, r := range rows {
		tm, err := teamFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, tm)
	}
	return out, nil
}

// TeamInsert creates tm; CreatedAt/UpdatedAt are set to the transaction
// time. A missing org fails with ErrFailedPrecondition.
func (t *Tx) TeamInsert(ctx context.Context, tm *Team) error {
	md, err := encodeMetadata(tm.Metadata)
	if err != nil {
		return err
	}
	tm.CreatedAt, tm.UpdatedAt = t.now, t.now
	return translate(t.q.TeamInsert(ctx, t.tx, dbsqlc.TeamInsertParams{
		ID: tm.ID, OrgID: tm.OrgID, Name: tm.Name, Limits: jsonOrEmpty(tm.Limits), Metadata: md,
		TrafficClass: tm.TrafficClass, ModelGroupAliases: encodeMap(tm.ModelGroupAliases), CreatedAt: t.now,
	}))
}

// TeamGetForUpdate returns team id locked for the rest of the
// transaction, if tn may see it.
func (t *Tx) TeamGetForUpdate(ctx context.Context, tn Tenant, id string) (Team, error) {
	r, err := t.q.TeamGetForUpdate(ctx, t.tx, dbsqlc.TeamGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID), TeamID: optStr(tn.TeamID)})
	if err != nil {
		return Team{}, orNotFound(err, "team "+id)
	}
	return teamFromRow(r)
}

// TeamUpdate writes tm's name, limits, metadata, traffic class and model
// group aliases.
func (t *Tx) TeamUpdate(ctx context.Context, tm *Team) error {
	md, err := encodeMetadata(tm.Metadata)
	if err != nil {
		return err
	}
	tm.UpdatedAt = t.now
	return translate(t.q.TeamUpdate(ctx, t.tx, dbsqlc.TeamUpdateParams{
		OrgID: tm.OrgID, ID: tm.ID, Name: tm.Name, Limits: jsonOrEmpty(tm.Limits), Metadata: md,
		TrafficClass: tm.TrafficClass, ModelGroupAliases: encodeMap(tm.ModelGroupAliases), UpdatedAt: t.now,
	}))
}

// TeamSetBlocked sets tm's block state.
func (t *Tx) TeamSetBlocked(ctx context.Context, tm *Team, blocked bool) error {
	tm.Blocked, tm.UpdatedAt = blocked, t.now
	return translate(t.q.TeamSetBlocked(ctx, t.tx, dbsqlc.TeamSetBlockedParams{
		OrgID: tm.OrgID, ID: tm.ID, Blocked: blocked, UpdatedAt: t.now,
	}))
}

// TeamDelete deletes team id of org orgID with its memberships (they
// cascade) and its revoked admin tokens. It fails with
// ErrFailedPrecondition, naming what remains, while keys or unrevoked
// admin tokens belong to the team.
func (t *Tx) TeamDelete(ctx context.Context, orgID, id string) error {
	c, err := t.q.TeamChildren(ctx, t.tx, dbsqlc.TeamChildrenParams{OrgID: orgID, ID: id})
	if err != nil {
		return fmt.Errorf("count team children: %w", err)
	}
	if c.Keys+c.AdminTokens > 0 {
		return &Error{Code: ErrFailedPrecondition, Msg: fmt.Sprintf(
			"team %s still has %d keys and %d admin tokens; delete the keys and revoke the admin tokens first",
			id, c.Keys, c.AdminTokens)}
	}
	if err := t.q.AdminTokenDeleteRevokedForTeam(ctx, t.tx, &id); err != nil {
		return fmt.Errorf("delete revoked admin tokens of team %s: %w", id, err)
	}
	return translate(t.q.TeamDelete(ctx, t.tx, dbsqlc.TeamDeleteParams{OrgID: orgID, ID: id}))
}
