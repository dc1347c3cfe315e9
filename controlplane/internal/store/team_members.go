package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// TeamMember is a user's membership of a team, with the user's limits
// inside that team. Team and user always belong to OrgID (the composite
// foreign keys enforce it).
type TeamMember struct {
	TeamID string
	UserID string
	OrgID  string
	// MaxBudgetInTeam is the user's budget in USD through this team per
	// budget window; nil means no member budget.
	MaxBudgetInTeam *float64
	Limits          []byte // JSON of sluice.admin.v1.Limits (member level)
	CreatedAt       time.Time
	UpdatedAt       time.Time
}

func teamMemberFromRow(r dbsqlc.TeamMember) TeamMember {
	return TeamMember{
		TeamID: r.TeamID, UserID: r.UserID, OrgID: r.OrgID, MaxBudgetInTeam: r.MaxBudgetInTeam,
		Limits: r.Limits, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}
}

// notMember is the NotFound error for a missing membership.
func notMember(teamID, userID string) error {
	return &Error{Code: ErrNotFound, Msg: "user " + userID + " is not a member of team " + teamID}
}

// TeamMemberList returns a page of the members of team teamID of org
// orgID, in user id order (Page.After is a user id). The caller has
// already checked that the team is visible.
func (s *Store) TeamMemberList(ctx context.Context, orgID, teamID string, p Page) ([]TeamMember, error) {
	rows, err := s.q.TeamMemberList(ctx, s.pool, dbsqlc.TeamMemberListParams{
		OrgID: orgID, TeamID: teamID, AfterUserID: p.After, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list members of team %s: %w", teamID, err)
	}
	out := make([]TeamMember, 0, len(rows))
	for _, r := range rows {
		out = append(out, teamMemberFromRow(r))
	}
	return out, nil
}

// TeamMemberInsert adds m; CreatedAt/UpdatedAt are set to the transaction
// time. It fails with ErrNotFound when m.UserID is not a user of m.OrgID
// and with ErrAlreadyExists when the user is already a member.
func (t *Tx) TeamMemberInsert(ctx context.Context, m *TeamMember) error {
	ok, err := t.q.TeamMemberUserExists(ctx, t.tx, dbsqlc.TeamMemberUserExistsParams{OrgID: m.OrgID, UserID: m.UserID})
	if err != nil {
		return fmt.Errorf("look up user %s: %w", m.UserID, err)
	}
	if !ok {
		// Users of other orgs are indistinguishable from missing ones.
		return notFound("user " + m.UserID)
	}
	m.CreatedAt, m.UpdatedAt = t.now, t.now
	return translate(t.q.TeamMemberInsert(ctx, t.tx, dbsqlc.TeamMemberInsertParams{
		TeamID: m.TeamID, UserID: m.UserID, OrgID: m.OrgID, MaxBudgetInTeam: m.MaxBudgetInTeam,
		Limits: jsonOrEmpty(m.Limits), CreatedAt: t.now,
	}))
}

// TeamMemberGetForUpdate returns the membership of userID in team teamID
// of org orgID, locked for the rest of the transaction.
func (t *Tx) TeamMemberGetForUpdate(ctx context.Context, orgID, teamID, userID string) (TeamMember, error) {
	r, err := t.q.TeamMemberGetForUpdate(ctx, t.tx, dbsqlc.TeamMemberGetForUpdateParams{OrgID: orgID, TeamID: teamID, UserID: userID})
	if isNoRows(err) {
		return TeamMember{}, notMember(teamID, userID)
	}
	if err != nil {
		return TeamMember{}, fmt.Errorf("get member %s of team %s: %w", userID, teamID, err)
	}
	return teamMemberFromRow(r), nil
}

// TeamMemberUpdate writes m's member budget and limits.
func (t *Tx) TeamMemberUpdate(ctx context.Context, m *TeamMember) error {
	m.UpdatedAt = t.now
	return translate(t.q.TeamMemberUpdate(ctx, t.tx, dbsqlc.TeamMemberUpdateParams{
		OrgID: m.OrgID, TeamID: m.TeamID, UserID: m.UserID, MaxBudgetInTeam: m.MaxBudgetInTeam,
		Limits: jsonOrEmpty(m.Limits), UpdatedAt: t.now,
	}))
}

// TeamMemberDelete removes the membership m.
func (t *Tx) TeamMemberDelete(ctx context.Context, m TeamMember) error {
	return translate(t.q.TeamMemberDelete(ctx, t.tx, dbsqlc.TeamMemberDeleteParams{OrgID: m.OrgID, TeamID: m.TeamID, UserID: m.UserID}))
}
