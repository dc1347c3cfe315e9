package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// User is a person or service identity of an org.
type User struct {
	ID          string
	OrgID       string
	Email       string // lower-cased, unique within the org
	DisplayName string
	Limits      []byte // JSON of sluice.admin.v1.Limits
	Blocked     bool
	Metadata    map[string]string
	CreatedAt   time.Time
	UpdatedAt   time.Time
}

// UserQuery filters UserList.
type UserQuery struct {
	EmailPrefix string
	Blocked     *bool
}

func userFromRow(r dbsqlc.User) (User, error) {
	md, err := decodeMetadata(r.Metadata)
	if err != nil {
		return User{}, err
	}
	return User{ID: r.ID, OrgID: r.OrgID, Email: r.Email, DisplayName: r.DisplayName, Limits: r.Limits,
		Blocked: r.Blocked, Metadata: md, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}, nil
}

// UserGet returns user id if t may see it. Users are org-level objects:
// only t.OrgID confines the read.
func (s *Store) UserGet(ctx context.Context, t Tenant, id string) (User, error) {
	r, err := s.q.UserGet(ctx, s.pool, dbsqlc.UserGetParams{ID: id, OrgID: optStr(t.OrgID)})
	if err != nil {
		return User{}, orNotFound(err, "user "+id)
	}
	return userFromRow(r)
}

// UserList returns a page of users visible to t, in id order.
func (s *Store) UserList(ctx context.Context, t Tenant, q UserQuery, p Page) ([]User, error) {
	rows, err := s.q.UserList(ctx, s.pool, dbsqlc.UserListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), EmailPrefix: q.EmailPrefix, Blocked: q.Blocked, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list users: %w", err)
	}
	out := make([]User, 0, len(rows))
	for _, r := range rows {
		u, err := userFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, u)
	}
	return out, nil
}

// UserInsert creates u; CreatedAt/UpdatedAt are set to the transaction time.
func (t *Tx) UserInsert(ctx context.Context, u *User) error {
	md, err := encodeMetadata(u.Metadata)
	if err != nil {
		return err
	}
	u.CreatedAt, u.UpdatedAt = t.now, t.now
	return translate(t.q.UserInsert(ctx, t.tx, dbsqlc.UserInsertParams{
		ID: u.ID, OrgID: u.OrgID, Email: u.Email, DisplayName: u.DisplayName, Limits: jsonOrEmpty(u.Limits),
		Metadata: md, CreatedAt: t.now,
	}))
}

// UserGetForUpdate returns user id locked for the rest of the transaction.
func (t *Tx) UserGetForUpdate(ctx context.Context, tn Tenant, id string) (User, error) {
	r, err := t.q.UserGetForUpdate(ctx, t.tx, dbsqlc.UserGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return User{}, orNotFound(err, "user "+id)
	}
	return userFromRow(r)
}

// UserUpdate writes u's email, display name, limits and metadata.
func (t *Tx) UserUpdate(ctx context.Context, u *User) error {
	md, err := encodeMetadata(u.Metadata)
	if err != nil {
		return err
	}
	u.UpdatedAt = t.now
	return translate(t.q.UserUpdate(ctx, t.tx, dbsqlc.UserUpdateParams{
		ID: u.ID, Email: u.Email, DisplayName: u.DisplayName, Limits: jsonOrEmpty(u.Limits), Metadata: md,
		UpdatedAt: t.now,
	}))
}

// UserSetBlocked sets u's block state.
func (t *Tx) UserSetBlocked(ctx context.Context, u *User, blocked bool) error {
	u.Blocked, u.UpdatedAt = blocked, t.now
	return translate(t.q.UserSetBlocked(ctx, t.tx, dbsqlc.UserSetBlockedParams{ID: u.ID, Blocked: blocked, UpdatedAt: t.now}))
}

// UserDelete deletes user u (locked by UserGetForUpdate) together with its
// team memberships, and returns the ids of the teams it was removed from.
// It fails with ErrFailedPrecondition, naming the count, while keys are
// owned by the user. The lock on u makes the check race-free: inserting a
// key that references u waits for this transaction.
func (t *Tx) UserDelete(ctx context.Context, u User) (teamIDs []string, err error) {
	n, err := t.q.UserKeyCount(ctx, t.tx, dbsqlc.UserKeyCountParams{OrgID: u.OrgID, UserID: u.ID})
	if err != nil {
		return nil, fmt.Errorf("count keys of user %s: %w", u.ID, err)
	}
	if n > 0 {
		return nil, &Error{Code: ErrFailedPrecondition, Msg: fmt.Sprintf(
			"user %s still owns %d %s; delete the keys or give them another owner first", u.ID, n, plural(n, "key", "keys"))}
	}
	teamIDs, err = t.q.UserTeamIDs(ctx, t.tx, dbsqlc.UserTeamIDsParams{OrgID: u.OrgID, ID: u.ID})
	if err != nil {
		return nil, fmt.Errorf("list team memberships of user %s: %w", u.ID, err)
	}
	// team_members rows go with the user (ON DELETE CASCADE).
	if err := translate(t.q.UserDelete(ctx, t.tx, u.ID)); err != nil {
		return nil, err
	}
	return teamIDs, nil
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
